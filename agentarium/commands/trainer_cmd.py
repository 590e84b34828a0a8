"""``agentarium trainer``: asynchronous GRPO on a run's trajectories (trainer.run_trainer)."""

from __future__ import annotations

import argparse
import sys

import trainer
from broker import NatsSettings
from trainer import LOSS_AGGS, MULTI_TURN, TrainerConfig

from ..tiny import resolve_model
from .common import (
    add_metrics_flags,
    add_nats_flags,
    metrics_server,
    run_async,
    settings_from_args,
)


def add_trainer_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainerConfig.__dataclass_fields__
    p = parser.add_argument
    p(
        "--run",
        required=True,
        help="run id: trains on trajectories.<run>.<agent>.* and publishes <run>'s weights",
    )
    p("--agent", required=True, metavar="NAME", help="agent whose trajectories are trained on")
    p(
        "--model",
        required=True,
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
        action="store_true",
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
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="release a group this long after its first member with >= 2 ok members, or drop it (default %(default)s)",
    )
    g.add_argument(
        "--ack-wait",
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
        "--weights-dir",
        metavar="DIR",
        help="shared-path mode: write each version under DIR/<run>/v<version>/ (a filesystem the engines' syncers also see) instead of the weights object store",
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
        action="store_true",
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
        metavar="FILE",
        help="append one CSV row per step here (plot it with `agentarium plot FILE`)",
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


def _dual_clip(value: str) -> float:
    if value.strip().lower() in ("none", "off"):
        return 0.0
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--dual-clip takes a number > 1 or 'none', got {value!r}"
        ) from None


def config_from_args(args: argparse.Namespace) -> TrainerConfig:
    return TrainerConfig(
        run=args.run,
        agent=args.agent,
        model_dir=str(args.model),
        group_size=args.group_size,
        groups_per_step=args.groups_per_step,
        micro_batch_size=args.micro_batch_size,
        lr=args.lr,
        weight_decay=args.weight_decay,
        grad_clip=args.grad_clip,
        seed=args.seed,
        clip_low=args.clip_low,
        clip_high=args.clip_high,
        dual_clip=args.dual_clip,
        kl_coef=args.kl_coef,
        entropy_coef=args.entropy_coef,
        bf16_autocast=args.bf16_autocast,
        loss_agg=args.loss_agg,
        loss_norm_tokens=args.loss_norm_tokens,
        std_norm=not args.no_std_norm,
        multi_turn=args.multi_turn,
        max_staleness=args.max_staleness,
        stale_policy=args.stale_policy,
        filter_flat_groups=args.filter_flat_groups,
        group_timeout_s=args.group_timeout,
        ack_wait_s=args.ack_wait,
        publish_every=args.publish_every,
        checkpoint_dir=args.checkpoint_dir,
        checkpoint_every=args.checkpoint_every,
        keep_checkpoints=args.keep_checkpoints,
        metrics_path=args.metrics,
        device=args.device,
        ray_workers=args.ray_workers,
    )


async def _train(args: argparse.Namespace, settings: NatsSettings) -> int:
    try:
        config = config_from_args(args)
    except (trainer.TrainerError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    publisher = (
        (lambda js, topology, cfg: None)
        if args.no_publish
        else trainer.store_publisher(args.weights_dir, args.keep_versions)
    )
    return await trainer.run_trainer(
        config,
        settings,
        resume=args.resume,
        max_steps=args.max_steps,
        make_publisher=publisher,
        torch_threads=args.torch_threads,
        metrics=metrics_server(args),
    )


def cmd_trainer(args: argparse.Namespace) -> int:
    args.model = str(resolve_model(args.model))
    return run_async(lambda: _train(args, settings_from_args(args)), service="agentarium-trainer")


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "trainer",
        help="asynchronous GRPO on a run's trajectories; publishes new weights",
        description="Group a run's training trajectories by group_id, run asynchronous GRPO updates with torch + "
        "transformers, publish new weights every --publish-every steps (object store + policy KV), and checkpoint. "
        "SIGTERM checkpoints and exits 0; --resume continues from the last checkpoint.",
    )
    add_trainer_arguments(parser)
    add_metrics_flags(parser)
    add_nats_flags(parser)
    parser.set_defaults(func=cmd_trainer)
