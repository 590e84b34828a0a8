"""``agentarium trainer``: asynchronous GRPO on a run's trajectories (trainer.run_trainer).

Its settings are the fields of ``TrainerConfig`` (the algorithm) and ``TrainerProcess`` (this
process), each one a flag, a key of a --config file and a KEY=VALUE override
(agentarium/commands/config_file.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import trainer
from broker import NatsSettings
from trainer import (
    LOSS_AGGS,
    MULTI_TURN,
    TASK_ADV_NORMS,
    TRACKERS,
    WEIGHT_TRANSPORTS,
    StreamConfig,
    TrainerConfig,
)

from ..tiny import resolve_model
from .common import (
    add_metrics_flags,
    add_nats_flags,
    metrics_server,
    run_async,
    settings_from_args,
)
from .config_file import (
    ConfigKeys,
    Resolved,
    add_config_arguments,
    connection_flags,
    metrics_flags,
    resolve,
)


@dataclass(frozen=True, kw_only=True)
class TrainerProcess:
    """What this trainer process does beside the algorithm (TrainerConfig's fields)."""

    max_steps: int | None = None  # counted across resumes; None: until SIGTERM
    # object-store, shared-path or stream; None: shared-path with weights_dir, else object-store
    weight_transport: str | None = None
    weights_dir: str | None = None  # where shared-path writes (stream's stored copy too)
    keep_versions: int = 3
    stream_engines: tuple[str, ...] = ()  # the engines a stream reaches (their base URLs)
    stream_address: str | None = None  # how they reach this process; None: found out
    stream_backend: str | None = None  # gloo or nccl; None: nccl on cuda, else gloo
    stream_timeout_s: float = 60.0
    publish: bool = True
    torch_threads: int | None = None


KEYS = ConfigKeys.of(
    "trainer",
    TrainerConfig,
    TrainerProcess,
    flagless={
        "agent": "the one-agent spelling kept for config files (agent: toy); --agent sets "
        "agents, and either key names what is trained",
        "adam_betas": "AdamW's (beta1, beta2), rarely changed: adam_betas: [0.9, 0.95]",
        "adv_eps": "a numerical guard in the advantage's denominator, not a tuning knob",
        "tis_clip": "the cap of truncated importance weights (stale_policy tis), 2 as in TIS",
        "min_group_members": "trainable members a timed-out group needs; below 2 nothing is learnt",
    },
    keyless={
        **connection_flags(),
        **metrics_flags(),
        "resume": "what this start does with the checkpoint directory, not a setting of the run: "
        "the config.yaml written there starts the run again, and with --resume continues it",
    },
)


def add_trainer_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainerConfig.__dataclass_fields__
    p = parser.add_argument
    p(
        "--run",
        required=True,
        help="run id: trains on trajectories.<run>.<agent>.* and publishes <run>'s weights",
    )
    p(
        "--agent",
        dest="agents",
        action=_Append,
        default=d["agents"].default,
        metavar="NAME",
        help="agent whose trajectories are trained on; repeat it to train one policy on several "
        "agents (tasks), or pass '*' for every agent of the run found at start (its stored "
        "trajectories and the agents with a rollout consumer)",
    )
    p(
        "--model",
        required=True,
        dest="model_dir",
        metavar="tiny|PATH",
        help="policy to train: 'tiny' or a local transformers model directory (the same one the engines serve)",
    )
    g = parser.add_argument_group("batch and optimiser")
    g.add_argument(
        "--group-size",
        type=int,
        default=d["group_size"].default,
        metavar="G",
        help="rollouts per task (a group completes at its trajectories' own group_size; this sizes buffers) (default %(default)s)",
    )
    g.add_argument(
        "--groups-per-step",
        type=int,
        default=d["groups_per_step"].default,
        metavar="B",
        help="groups per optimizer step (default %(default)s)",
    )
    g.add_argument(
        "--micro-batch-size",
        type=int,
        default=0,
        metavar="ROWS",
        help="rows per forward/backward pass, gradients accumulated; 0 = the whole batch at once (default %(default)s)",
    )
    g.add_argument(
        "--lr",
        type=float,
        default=d["lr"].default,
        help="AdamW learning rate (default %(default)s)",
    )
    g.add_argument(
        "--weight-decay", type=float, default=0.0, help="AdamW weight decay (default %(default)s)"
    )
    g.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="clip the gradient's global norm to this; 0 = off (default %(default)s)",
    )
    g.add_argument(
        "--seed",
        type=int,
        default=0,
        help="base seed; each step's seed derives from (seed, step) (default %(default)s)",
    )
    g.add_argument(
        "--max-steps",
        type=int,
        default=None,
        metavar="N",
        help="stop after step N (counted across resumes); default: run until SIGTERM",
    )
    g = parser.add_argument_group("several agents (tasks)")
    g.add_argument(
        "--task-mix",
        default=d["task_mix"].default,
        metavar="proportional|balanced|a=W,b=W",
        help="how each step's groups are shared between agents: proportional (the oldest ready "
        "groups whatever their agent), balanced (equal shares) or weights per agent "
        "(a=0.7,b=0.3) (default %(default)s)",
    )
    g.add_argument(
        "--task-wait",
        dest="task_wait_s",
        type=float,
        default=d["task_wait_s"].default,
        metavar="SECONDS",
        help="with balanced or weighted shares, how long a step waits for an agent short of its "
        "share before giving that share to the others (default %(default)s)",
    )
    g.add_argument(
        "--task-adv-norm",
        choices=TASK_ADV_NORMS,
        default=d["task_adv_norm"].default,
        help="standardise advantages per agent after the group's: token weighs each trajectory "
        "by its trained tokens, trajectory counts each once; flat groups stay 0 "
        "(default %(default)s)",
    )
    g.add_argument(
        "--success-threshold",
        type=float,
        metavar="REWARD",
        default=d["success_threshold"].default,
        help="a trajectory succeeds when its reward is at least this (the success/<agent> "
        "metric) (default %(default)s)",
    )
    g = parser.add_argument_group("GRPO loss")
    g.add_argument(
        "--clip-low",
        type=float,
        default=0.2,
        help="ratio clip below 1: min ratio 1 - clip_low (default %(default)s)",
    )
    g.add_argument(
        "--clip-high",
        type=float,
        default=0.2,
        help="ratio clip above 1: max ratio 1 + clip_high; DAPO uses 0.28 (default %(default)s)",
    )
    g.add_argument(
        "--dual-clip",
        type=_dual_clip,
        default=d["dual_clip"].default,
        metavar="C|none",
        help="dual-clip: a token with a negative advantage stops adding loss once its ratio passes C (verl's clip_ratio_c); 'none' or 0 = off (default %(default)s)",
    )
    g.add_argument(
        "--kl-coef",
        type=float,
        default=0.0,
        help="weight of the k3 KL to the frozen initial model; 0 = off, no reference model loaded (default %(default)s)",
    )
    g.add_argument(
        "--entropy-coef",
        type=float,
        default=0.0,
        help="weight of an entropy bonus on model tokens; small values (0.01-0.05) stop a tiny policy "
        "collapsing onto one answer before it learns (default %(default)s)",
    )
    g.add_argument(
        "--bf16",
        dest="bf16_autocast",
        action="store_true",
        help="run forward passes under bf16 autocast (fast on GPUs); weights, gradients and the "
        "optimizer stay fp32, log-probs are computed in fp32",
    )
    g.add_argument(
        "--loss-agg",
        choices=LOSS_AGGS,
        default="token-mean",
        help="token-mean: every model token weighs the same (DAPO); seq-mean-token-mean: mean per sequence, then over sequences (GRPO paper); seq-mean-token-sum-norm: token sum / --loss-norm-tokens per sequence, mean over sequences (Dr. GRPO) (default %(default)s)",
    )
    g.add_argument(
        "--loss-norm-tokens",
        type=int,
        default=1024,
        help="the constant divisor of seq-mean-token-sum-norm (default %(default)s)",
    )
    g.add_argument(
        "--no-std-norm",
        dest="std_norm",
        action="store_false",
        help="advantage = reward - group mean, not divided by the group std (Dr. GRPO)",
    )
    g.add_argument(
        "--multi-turn",
        choices=MULTI_TURN,
        default="concat",
        help="concat: a multi-call rollout whose prompts extend each other is one sequence, observations masked; per-call: one row per LLM call (default %(default)s)",
    )
    g = parser.add_argument_group("groups and off-policy control")
    g.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        metavar="S",
        help="trajectories sampled more than S published versions ago are dropped or importance-weighted (default %(default)s)",
    )
    g.add_argument(
        "--sync-rollouts",
        action="store_true",
        help="synchronous training: train only trajectories of the current version (sets "
        "--max-staleness 0), publish every step, and wait until the run's engines serve the new "
        "version before taking the next batch; the producer must release each batch only then "
        "(agentarium demo --sync-rollouts does)",
    )
    g.add_argument(
        "--stale-policy",
        choices=("drop", "tis"),
        default="drop",
        help="drop: too-stale trajectories are counted and skipped; tis: trained with truncated importance weights min(pi/pi_rollout, 2) (default %(default)s)",
    )
    g.add_argument(
        "--filter-flat-groups",
        action="store_true",
        help="skip groups whose rewards are all equal (zero advantage), waiting for informative ones instead (DAPO's dynamic sampling)",
    )
    g.add_argument(
        "--group-timeout",
        dest="group_timeout_s",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="release a group this long after its first member with >= 2 ok members, or drop it (default %(default)s)",
    )
    g.add_argument(
        "--ack-wait",
        dest="ack_wait_s",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="trajectory consumer ack wait; unacked trajectories are heartbeated every third of it (default %(default)s)",
    )
    g = parser.add_argument_group("outputs")
    g.add_argument(
        "--publish-every",
        type=int,
        default=1,
        metavar="K",
        help="publish new weights every K steps (default %(default)s)",
    )
    g.add_argument(
        "--weight-transport",
        choices=WEIGHT_TRANSPORTS,
        default=None,
        help="how new weights reach the engines: object-store (the default: `agentarium sync` "
        "beside the engines fetches each version), shared-path (files under --weights-dir, "
        "which the syncers read in place; the default when --weights-dir is given) or stream "
        "(this process broadcasts each version to the --stream-engine URLs over "
        "torch.distributed, no file, then stores it as object-store, or shared-path with "
        "--weights-dir, does: the syncers catch up any engine the stream missed)",
    )
    g.add_argument(
        "--weights-dir",
        metavar="DIR",
        help="shared-path mode: write each version under DIR/<run>/v<version>/ (a filesystem the engines' syncers also see) instead of the weights object store",
    )
    g.add_argument(
        "--stream-engine",
        dest="stream_engines",
        action=_Append,
        default=TrainerProcess.__dataclass_fields__["stream_engines"].default,
        metavar="URL",
        help="with --weight-transport stream: an engine's base URL (SGLang or the local engine); "
        "repeat it for every engine",
    )
    g.add_argument(
        "--stream-address",
        metavar="HOST",
        help="with --weight-transport stream: the address the engines reach this process at "
        "(the group's master_address); default 127.0.0.1 when every engine is local, else this "
        "machine's address on the route to the first engine",
    )
    g.add_argument(
        "--stream-backend",
        choices=("gloo", "nccl"),
        default=None,
        help="with --weight-transport stream: the torch.distributed backend (default: nccl with "
        "--device cuda, else gloo; the local engine takes gloo only)",
    )
    g.add_argument(
        "--stream-timeout",
        dest="stream_timeout_s",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --weight-transport stream: longest wait for the engines to join the group and "
        "for each broadcast; an engine that times out keeps its weights until the syncer "
        "brings it the stored version (default %(default)s)",
    )
    g.add_argument(
        "--keep-versions",
        type=int,
        default=3,
        metavar="K",
        help="published versions kept per run; older ones are pruned (default %(default)s)",
    )
    g.add_argument(
        "--no-publish",
        dest="publish",
        action="store_false",
        help="train without publishing weights (the fleet keeps serving what it has; staleness stays 0)",
    )
    g.add_argument(
        "--checkpoint-dir",
        metavar="DIR",
        help="write checkpoints here; trajectories are acked only once a checkpoint covers them (without it: right after their step, and nothing can resume)",
    )
    g.add_argument(
        "--checkpoint-every",
        type=int,
        default=10,
        metavar="N",
        help="checkpoint every N steps, and on SIGTERM and at the end (default %(default)s)",
    )
    g.add_argument(
        "--keep-checkpoints",
        type=int,
        default=3,
        metavar="K",
        help="keep the weights of the newest K checkpoints (job id lists are always kept) (default %(default)s)",
    )
    g.add_argument(
        "--resume",
        action="store_true",
        help="continue from the newest checkpoint in --checkpoint-dir (starts fresh if there is none)",
    )
    g.add_argument(
        "--metrics",
        dest="metrics_path",
        metavar="FILE",
        help="append one CSV row per step here (plot it with `agentarium plot FILE`)",
    )
    g.add_argument(
        "--report-to",
        default=d["report_to"].default,
        metavar="LIST",
        help=f"experiment trackers, comma-separated: any of {','.join(TRACKERS)}, or none; each "
        "step's metrics go to every one, under the same names (default: csv, the --metrics file). "
        "W&B runs offline unless WANDB_MODE says otherwise; MLflow writes a SQLite file unless "
        "MLFLOW_TRACKING_URI is set",
    )
    g.add_argument(
        "--tracker-dir",
        metavar="DIR",
        help="where tensorboard/, wandb/ and mlflow.db go (default: the --metrics file's "
        "directory, else --checkpoint-dir, else ./runs/<run>)",
    )
    g = parser.add_argument_group("compute")
    g.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default="cpu",
        help="where the model trains (default %(default)s)",
    )
    g.add_argument(
        "--ray-workers",
        type=int,
        default=0,
        metavar="N",
        help="data-parallel workers as Ray actors (gloo on CPU, nccl on CUDA, one GPU each); 0 = train in this process (default %(default)s)",
    )
    g.add_argument(
        "--torch-threads",
        type=int,
        default=None,
        metavar="N",
        help="torch CPU threads in this process (default: torch's choice)",
    )
    add_config_arguments(parser, KEYS)


class _Append(argparse.Action):
    """``append`` whose default is not a list (the key's default, ``()``, wrapped in
    ``Unset`` until resolve): the first use starts a fresh list."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        current = getattr(namespace, self.dest, None)
        items = list(current) if isinstance(current, list) else []
        setattr(namespace, self.dest, [*items, values])


def _dual_clip(value: str) -> float:
    if value.strip().lower() in ("none", "off"):
        return 0.0
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--dual-clip takes a number > 1 or 'none', got {value!r}"
        ) from None


def _default_report_to() -> tuple[str, ...]:
    return tuple(TrainerConfig.__dataclass_fields__["report_to"].default)  # type: ignore[arg-type]


def resolve_args(args: argparse.Namespace) -> tuple[TrainerConfig, TrainerProcess, Resolved]:
    """The trainer's settings from defaults, --config, flags and overrides, validated."""
    resolved = resolve(args, KEYS)
    values = resolved.pick(TrainerConfig)
    # agent (one) and agents (several) name the same setting: the one set by the
    # higher-precedence source (file < flag < override) wins, in what is recorded too
    rank = {None: -1, "file": 0, "flag": 1, "override": 2}
    agent_rank, agents_rank = (rank[resolved.sources.get(k)] for k in ("agent", "agents"))
    if values["agent"] and values["agents"] and agent_rank != agents_rank:
        loser, empty = ("agent", "") if agents_rank > agent_rank else ("agents", ())
        values[loser] = resolved.values[loser] = empty
    values["model_dir"] = str(resolve_model(str(values["model_dir"])))
    config = TrainerConfig(**values)
    # csv alone is the default (written only with --metrics); asked for beside other trackers,
    # it needs its file. Not keyed on where report_to came from: a written config.yaml holds it.
    asked = config.report_to != _default_report_to()
    if asked and "csv" in config.report_to and not config.metrics_path:
        raise trainer.TrainerConfigError(
            "--report-to csv writes the --metrics file: pass --metrics FILE as well"
        )
    return config, TrainerProcess(**resolved.pick(TrainerProcess)), resolved


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return resolve_args(args)[0]


async def train(args: argparse.Namespace, settings: NatsSettings) -> int:
    try:
        config, process, resolved = resolve_args(args)
    except (trainer.TrainerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        publisher = make_publisher(config, process)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return await trainer.run_trainer(
        config,
        settings,
        resume=args.resume,
        max_steps=process.max_steps,
        make_publisher=publisher,
        torch_threads=process.torch_threads,
        run_config=resolved.values,
        config_source=resolved.describe(),
        metrics=metrics_server(args),
    )


def make_publisher(config: TrainerConfig, process: TrainerProcess) -> trainer.PublisherFactory:
    """The publisher of the chosen --weight-transport; ValueError for contradicting settings."""
    if not process.publish:
        return lambda js, topology, cfg: None
    weights_dir = Path(process.weights_dir) if process.weights_dir else None
    transport = process.weight_transport or ("shared-path" if weights_dir else "object-store")
    if transport not in WEIGHT_TRANSPORTS:
        raise ValueError(
            f"weight_transport {transport!r} is not one of {', '.join(WEIGHT_TRANSPORTS)}"
        )
    if transport == "shared-path" and weights_dir is None:
        raise ValueError("--weight-transport shared-path writes under --weights-dir: pass it")
    if transport == "object-store" and weights_dir is not None:
        raise ValueError(
            "--weights-dir is the shared-path mode's directory: drop it, or pass "
            "--weight-transport shared-path (or stream)"
        )
    if transport != "stream":
        if process.stream_engines:
            raise ValueError("--stream-engine is for --weight-transport stream")
        return trainer.store_publisher(weights_dir, process.keep_versions)
    stream = StreamConfig(
        engines=tuple(process.stream_engines),
        master_address=process.stream_address,
        backend=process.stream_backend or ("nccl" if config.device == "cuda" else "gloo"),
        timeout_s=process.stream_timeout_s,
    )
    return trainer.stream_publisher(stream, weights_dir, process.keep_versions)


def cmd_trainer(args: argparse.Namespace) -> int:
    return run_async(lambda: train(args, settings_from_args(args)), service="agentarium-trainer")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "trainer",
        help="asynchronous GRPO on a run's trajectories; publishes new weights",
        description="Group a run's training trajectories by group_id, run asynchronous GRPO updates with torch + "
        "transformers, publish new weights every --publish-every steps (object store + policy KV; or a shared path, "
        "or streamed to the engines over torch.distributed first: --weight-transport), and checkpoint. "
        "SIGTERM checkpoints and exits 0; --resume continues from the last checkpoint. Settings may come "
        "from --config FILE.yaml and KEY=VALUE overrides (defaults < file < flags < overrides); the "
        "resolved ones are logged once and written to <checkpoint-dir>/config.yaml.",
    )
    add_trainer_arguments(parser)
    add_metrics_flags(parser)
    add_nats_flags(parser)
    parser.set_defaults(func=cmd_trainer)
