"""TrainerConfig: every setting of the asynchronous GRPO algorithm, declared once.

Each field is a ``setting`` (schemas/settings.py): ``agentarium trainer`` derives its flags,
``--config`` keys, help and defaults from these fields, and ``check_settings`` their bounds and
choices; the checks that relate two settings are in ``__post_init__``.
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentarium.schemas import SettingError, check_name, check_settings, setting

from .errors import TrainerConfigError
from .heap import HEAP_MODES
from .memory import MEMORY_PLANS
from .mix import TaskMix
from .rows import MULTI_TURN
from .trackers import TRACKERS, check_installed, parse_report_to

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
STALE_POLICIES = ("drop", "tis", "mask")
DEVICES = ("cpu", "cuda")
OPTIMIZER_STATES = ("fp32", "fp8")  # AdamW's moments (trainer/optim.py)
PARALLEL = ("replicated", "fsdp")  # data parallel: a full replica per rank, or FSDP2 shards
TASK_ADV_NORMS = ("none", "token", "trajectory")
OVERLONG = ("keep", "filter", "reward")  # a response cut at max_new_tokens (trainer/groups.py)
EVERY_AGENT = "*"  # --agent '*': every agent of the run (trainer/tasks.py, discover_agents)
DEFAULT_REPORT_TO = ("csv",)

BATCH = "batch and optimiser"
TASKS = "several agents (tasks)"
LOSS = "GRPO loss"
GROUPS = "groups and off-policy control"
OUTPUTS = "outputs"
COMPUTE = "compute"


def parse_dual_clip(value: str) -> float:
    """``--dual-clip``'s text: a number, or 'none'/'off' (0, no dual clip)."""
    if value.strip().lower() in ("none", "off"):
        return 0.0
    try:
        return float(value)
    except ValueError:
        # argparse shows this message as it is (a ValueError would read "invalid value")
        raise argparse.ArgumentTypeError(
            f"--dual-clip takes a number > 1 or 'none', got {value!r}"
        ) from None


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Settings of one trainer process's algorithm; each field is a flag and a config key."""

    run: str = setting(
        help="run id: trains on trajectories.<run>.<agent>.* and publishes <run>'s weights"
    )
    # The agents (tasks) trained: `agents` (--agent, repeatable; '*' = every agent of the run);
    # `agent` is the one-agent spelling, kept for config files and callers that name one.
    # After validation `agents` always holds them and `agent` is set only for exactly one.
    agent: str = setting(
        "",
        flagless="the one-agent spelling kept for config files (agent: toy); --agent sets "
        "agents, and either key names what is trained",
    )
    agents: tuple[str, ...] = setting(
        (),
        flag="--agent",
        metavar="NAME",
        help="agent whose trajectories are trained on; repeat it to train one policy on several "
        "agents (tasks), or pass '*' for every agent of the run found at start (its stored "
        "trajectories and the agents with a rollout consumer)",
    )
    model_dir: str = setting(
        flag="--model",
        metavar="tiny|smol|PATH",
        help="policy to train, required: 'tiny', 'smol' or a local transformers model directory, "
        "the same one the engines serve (no default: a default unlike the engines' model would "
        "train another policy without a word)",
    )
    # batch shape
    group_size: int = setting(
        8,
        ge=2,
        group=BATCH,
        metavar="G",
        help="rollouts per task, 2 or more: a group of one has no baseline (a group completes "
        "at its trajectories' own group_size; this sizes buffers)",
    )
    groups_per_step: int = setting(
        16, gt=0, group=BATCH, metavar="B", help="groups per optimizer step"
    )
    micro_batch_size: int = setting(
        0,
        ge=0,
        group=BATCH,
        metavar="ROWS",
        help="rows per forward/backward pass, gradients accumulated; 0 = no limit in rows",
    )
    max_tokens_per_micro_batch: int = setting(
        0,
        ge=0,
        group=BATCH,
        metavar="TOKENS",
        help="tokens per forward/backward pass (real tokens when rows are packed, rows x the "
        "longest row with --no-pack-rows), consecutive rows filling each pass and a longer row "
        "alone; "
        "0 = no limit in tokens (with --micro-batch-size 0 too: the whole batch at once)",
    )
    # optimisation
    lr: float = setting(1e-5, ge=0, group=BATCH, help="AdamW learning rate")
    weight_decay: float = setting(0.0, ge=0, group=BATCH, help="AdamW weight decay")
    adam_betas: tuple[float, float] = setting(
        (0.9, 0.999),
        flagless="AdamW's (beta1, beta2), rarely changed: adam_betas: [0.9, 0.95]",
    )
    optimizer_state: str = setting(
        "auto",
        choices=("auto", *OPTIMIZER_STATES),
        group=BATCH,
        help="how AdamW keeps its two moments: fp32 (8 bytes a trained parameter), or fp8: "
        "the first as 8-bit floats with an fp32 scale per 256 values, the second's root as "
        "bfloat16, rounded stochastically (3.02 bytes: trainer/optim.py); fp8 takes --dtype "
        "float32 and --parallel replicated; auto: fp8 where it may be under --memory small, "
        "else fp32",
    )
    grad_clip: float = setting(
        1.0, ge=0, group=BATCH, help="clip the gradient's global norm to this; 0 = off"
    )
    seed: int = setting(
        0, group=BATCH, help="base seed; each step's seed derives from (seed, step)"
    )
    # several agents: how each step's groups are shared (trainer/mix.py), how long a step
    # waits for a short task, and the optional per-task advantage normalisation (grpo.py)
    task_mix: str = setting(
        "proportional",
        group=TASKS,
        metavar="proportional|balanced|a=W,b=W",
        help="how each step's groups are shared between agents: proportional (the oldest ready "
        "groups whatever their agent), balanced (equal shares) or weights per agent "
        "(a=0.7,b=0.3)",
    )
    task_wait_s: float = setting(
        30.0,
        ge=0,
        group=TASKS,
        help="with balanced or weighted shares, how long a step waits for an agent short of its "
        "share before giving that share to the others",
    )
    task_adv_norm: str = setting(
        "none",
        choices=TASK_ADV_NORMS,
        group=TASKS,
        help="standardise advantages per agent after the group's: token weighs each trajectory "
        "by its trained tokens, trajectory counts each once; flat groups stay 0",
    )
    success_threshold: float = setting(
        1.0,
        group=TASKS,
        metavar="REWARD",
        help="a trajectory succeeds when its reward is at least this (the success/<agent> metric)",
    )
    # GRPO loss
    clip_low: float = setting(
        0.2, ge=0, group=LOSS, help="ratio clip below 1: min ratio 1 - clip_low"
    )
    clip_high: float = setting(
        0.2, ge=0, group=LOSS, help="ratio clip above 1: max ratio 1 + clip_high; DAPO uses 0.28"
    )
    # dual-clip: for A < 0 the loss is capped at -A * dual_clip (verl's clip_ratio_c); 0 or None
    # turns it off
    dual_clip: float | None = setting(
        3.0,
        group=LOSS,
        metavar="C|none",
        parse=parse_dual_clip,
        help="dual-clip: a token with a negative advantage stops adding loss once its ratio "
        "passes C (verl's clip_ratio_c); 'none' or 0 = off",
    )
    kl_coef: float = setting(
        0.0,
        ge=0,
        group=LOSS,
        help="weight of the k3 KL to the frozen initial model; 0 = off, no reference model loaded",
    )
    # a bonus on the policy entropy of model tokens (not textbook GRPO)
    entropy_coef: float = setting(
        0.0,
        ge=0,
        group=LOSS,
        help="weight of an entropy bonus on model tokens; small values (0.01-0.05) stop a tiny "
        "policy collapsing onto one answer before it learns",
    )
    bf16_autocast: bool = setting(
        False,
        flag="--bf16",
        group=LOSS,
        help="run forward passes under bf16 autocast (fast on GPUs); weights, gradients and the "
        "optimizer stay fp32, log-probs are computed in fp32",
    )
    # The master weights' dtype. float64 is for numerical checks: two correct implementations
    # of one update (sharded and one-process, tests/test_fsdp.py) then agree to ~1e-16
    # relative, where in fp32 AdamW's division by the root of the second moment turns a
    # gradient's rounding noise into steps of up to lr on parameters with no true gradient.
    dtype: str = setting(
        "float32",
        choices=("float32", "float64"),
        group=LOSS,
        help="dtype of the weights, gradients and optimizer state (float64: numerical checks, "
        "8 bytes a value instead of 4; log-probs are computed in at least fp32)",
    )
    loss_agg: str = setting(
        "token-mean",
        choices=LOSS_AGGS,
        group=LOSS,
        help="token-mean: every model token weighs the same (DAPO); seq-mean-token-mean: mean "
        "per sequence, then over sequences (GRPO paper); seq-mean-token-sum-norm: token sum / "
        "--loss-norm-tokens per sequence, mean over sequences (Dr. GRPO)",
    )
    loss_norm_tokens: int = setting(
        1024, gt=0, group=LOSS, help="the constant divisor of seq-mean-token-sum-norm"
    )
    std_norm: bool = setting(
        True,
        negate=True,
        group=LOSS,
        help="advantage = reward - group mean, not divided by the group std (Dr. GRPO)",
    )
    # >= 0; a flat group has zero advantages whatever it is
    adv_eps: float = setting(
        1e-6,
        ge=0,
        flagless="a numerical guard in the advantage's denominator, not a tuning knob",
    )
    multi_turn: str = setting(
        "concat",
        choices=MULTI_TURN,
        group=LOSS,
        help="concat: a multi-call rollout whose prompts extend each other is one sequence, "
        "observations masked; per-call: one row per LLM call",
    )
    # off-policy control and group buffering
    max_staleness: int = setting(
        4,
        ge=0,
        group=GROUPS,
        metavar="S",
        help="tokens sampled more than S published versions ago are too stale (each token by "
        "its own version); --stale-policy says what becomes of them",
    )
    stale_policy: str = setting(
        "drop",
        choices=STALE_POLICIES,
        group=GROUPS,
        help="a trajectory with too-stale tokens, whose reward always stays in its group's "
        "baseline: drop: not trained (dropped_stale); tis: its too-stale tokens trained with "
        "truncated importance weights min(pi/pi_rollout, 2) (tis_weighted); mask: its too-stale "
        "tokens masked out of the loss, its fresher tokens trained (stale_masked)",
    )
    # synchronous training (the baseline asynchronous RL is measured against): every step trains
    # only trajectories of the current version (max_staleness is set to 0), publishes, and waits
    # until the run's engines serve the new version before it takes the next batch
    sync_rollouts: bool = setting(
        False,
        group=GROUPS,
        help="synchronous training: train only trajectories of the current version (sets "
        "--max-staleness 0), publish every step, and wait until the run's engines serve the new "
        "version before taking the next batch; the producer must release each batch only then "
        "(agentarium demo --sync-rollouts does)",
    )
    tis_clip: float = setting(
        2.0,
        gt=0,
        flagless="the cap of truncated importance weights (stale_policy tis), 2 as in TIS",
    )
    filter_flat_groups: bool = setting(
        False,
        group=GROUPS,
        help="skip groups whose rewards are all equal (zero advantage), waiting for informative "
        "ones instead (DAPO's dynamic sampling)",
    )
    # DAPO's dynamic sampling: dropped groups replaced by groups asked from the producers
    # (trainer/draws.py), and what happens to responses cut at max_new_tokens (trainer/groups.py)
    dynamic_sampling: bool = setting(
        False,
        group=GROUPS,
        help="keep every step at --groups-per-step: flat groups (and groups the selection "
        "drops for any reason) are replaced by new groups asked from the run's producers over "
        "<p>.demand.<run>.<agent> (a producers.GroupRefill answers; agentarium demo "
        "--dynamic-sampling runs one); turns --filter-flat-groups on",
    )
    draw_limit: int = setting(
        3,
        gt=0,
        group=GROUPS,
        metavar="K",
        help="with --dynamic-sampling, a step asks for at most K x --groups-per-step "
        "replacement groups; past that it trains the groups it holds",
    )
    overlong: str = setting(
        "keep",
        choices=OVERLONG,
        group=GROUPS,
        help="responses cut at max_new_tokens (finish_reason length): keep them, filter them out "
        "of statistics and training, or give them --overlong-reward (DAPO's overlong filtering "
        "and its punishment); counted either way",
    )
    overlong_reward: float = setting(
        0.0,
        group=GROUPS,
        metavar="REWARD",
        help="with --overlong reward, the reward a response cut at max_new_tokens gets",
    )
    group_timeout_s: float = setting(
        600.0,
        gt=0,
        group=GROUPS,
        help="release a group this long after its first member with >= 2 ok members, or drop it",
    )
    min_group_members: int = setting(
        2,
        ge=2,
        flagless="trainable members a timed-out group needs; below 2 nothing is learnt",
    )
    ack_wait_s: float = setting(
        300.0,
        ge=3,  # heartbeats go every third of it
        group=GROUPS,
        help="trajectory consumer ack wait; unacked trajectories are heartbeated every third of it",
    )
    # outputs
    publish_every: int = setting(
        1, gt=0, group=OUTPUTS, metavar="K", help="publish new weights every K steps"
    )
    checkpoint_dir: str | None = setting(
        None,
        group=OUTPUTS,
        metavar="DIR",
        help="write checkpoints here; trajectories are acked only once a checkpoint covers them "
        "(without it: right after their step, and nothing can resume)",
    )
    checkpoint_every: int = setting(
        10,
        gt=0,
        group=OUTPUTS,
        metavar="N",
        help="checkpoint every N steps, and on SIGTERM and at the end",
    )
    keep_checkpoints: int = setting(
        3,
        gt=0,
        group=OUTPUTS,
        metavar="K",
        help="keep the weights of the newest K checkpoints (job id lists are always kept)",
    )
    metrics_path: str | None = setting(
        None,
        flag="--metrics",
        group=OUTPUTS,
        metavar="FILE",
        help="append one CSV row per step here (plot it with `agentarium plot FILE`)",
    )
    # experiment trackers, any of csv (the metrics_path file), tensorboard, wandb, mlflow; a
    # comma-separated string or a list is accepted and normalised to a tuple
    report_to: tuple[str, ...] = setting(
        DEFAULT_REPORT_TO,
        group=OUTPUTS,
        metavar="LIST",
        help=f"experiment trackers, comma-separated: any of {','.join(TRACKERS)}, or none; each "
        "step's metrics go to every one, under the same names (default: csv, the --metrics "
        "file). W&B runs offline unless WANDB_MODE says otherwise; MLflow writes a SQLite file "
        "unless MLFLOW_TRACKING_URI is set",
    )
    tracker_dir: str | None = setting(
        None,
        group=OUTPUTS,
        metavar="DIR",
        help="where tensorboard/, wandb/ and mlflow.db go (default: the --metrics file's "
        "directory, else --checkpoint-dir, else ./runs/<run>)",
    )
    device: str = setting("cpu", choices=DEVICES, group=COMPUTE, help="where the model trains")
    ray_workers: int = setting(
        0,
        ge=0,
        group=COMPUTE,
        help="data-parallel workers as Ray actors (gloo on CPU, nccl on CUDA, one GPU each); "
        "0 = train in this process",
    )
    parallel: str = setting(
        "replicated",
        choices=PARALLEL,
        group=COMPUTE,
        help="replicated: every --ray-workers rank holds the whole model, reference and AdamW "
        "state; fsdp: each holds 1/N of them (PyTorch FSDP2, sharded per decoder layer), "
        "checkpoints are sharded, and --bf16 on CUDA is FSDP's mixed precision (fp32 master "
        "weights)",
    )
    # LoRA (trainer/lora.py): adapters on a frozen base; only they train and are published
    lora_rank: int = setting(
        0,
        ge=0,
        group=COMPUTE,
        metavar="R",
        help="train LoRA adapters of rank R on the frozen base model (peft) instead of every "
        "weight; each version published is the adapter alone, which engines load with "
        "/load_lora_adapter (`agentarium merge-lora` folds it into the base); 0 = full "
        "fine-tuning",
    )
    lora_alpha: float = setting(
        32.0, gt=0, group=COMPUTE, help="LoRA's alpha: the adapter's update is scaled by alpha/R"
    )
    lora_target_modules: tuple[str, ...] = setting(
        ("all-linear",),
        group=COMPUTE,
        metavar="NAME",
        help="modules that get adapters (repeatable: q_proj, v_proj, ...); all-linear = every "
        "linear layer but the output head",
    )
    logprob_chunk: int = setting(
        512,
        ge=0,
        group=COMPUTE,
        metavar="POSITIONS",
        help="log-probs are taken only at the loss's (model-token) positions, through the output "
        "head and log_softmax in fp32 this many positions at a time, each chunk's gradient made "
        "while its logits are held (recomputed in the backward pass under FSDP2 or a wrapped "
        "head) (memory: a chunk's logits, not the batch's); 0 = the whole vocabulary at "
        "every position at once, the model's own logits (trainer/logprobs.py)",
    )
    mlp_chunk: int = setting(
        0,
        ge=0,
        group=COMPUTE,
        metavar="POSITIONS",
        help="run each decoder layer's feed-forward block this many positions at a time in a "
        "longer pass, each slice recomputed in the backward pass (memory: a slice's "
        "activations, not a long row's; one more feed-forward pass, for long passes only: "
        "trainer/chunked_mlp.py); 0 = whole (--memory small sets 512)",
    )
    layer_chunk: int = setting(
        0,
        ge=0,
        group=COMPUTE,
        metavar="POSITIONS",
        help="under activation checkpointing, run each decoder layer of a longer pass this "
        "many positions at a time (its keys and values computed once for the pass) and keep "
        "every second layer's input only (memory: a slice's activations, half the inputs; "
        "more work in long passes only: trainer/sliced_layers.py); packed rows of a "
        "plain causal model only, others run as before; not with --parallel fsdp; 0 = whole "
        "(--memory small sets 512 in a replicated trainer)",
    )
    activation_checkpointing: bool = setting(
        False,
        group=COMPUTE,
        help="recompute each decoder layer's activations in the backward pass instead of "
        "keeping them (less memory, about a third more compute), in every --parallel mode",
    )
    memory: str = setting(
        "auto",
        choices=MEMORY_PLANS,
        group=COMPUTE,
        help="the memory plan: fast takes the settings as given; small adds activation "
        "checkpointing, --optimizer-state fp8 (where auto and allowed), passes of 256 real "
        "tokens when no --max-tokens-per-micro-batch or --micro-batch-size is set, "
        "log-probs 128 positions at a time at most (32 in a longer pass), and --mlp-chunk and --layer-chunk 512 "
        "when they are 0 "
        "(SmolLM2-135M, 16 rows: under 2 GiB of RSS against 7-8 GB, a slower step: "
        "trainer/memory.py); auto: small when "
        "every weight of a model of 100M parameters or more is trained, else fast (LoRA, small "
        "models)",
    )
    heap: str = setting(
        "release",
        choices=HEAP_MODES,
        group=COMPUTE,
        help="release (the default): give the memory each pass and each step free back to the "
        "system (glibc's malloc_trim after each pass and step: trainer/heap.py); default: "
        "leave glibc's allocator as it is, which keeps many times what a step's tensors need",
    )
    pack_rows: bool = setting(
        True,
        negate=True,
        group=COMPUTE,
        help="pad each pass's rows to its longest row instead of packing them (by default a "
        "pass runs its rows' real tokens as one sequence, attention kept within each row: "
        "trainer/packing.py)",
    )
    share_prefix: bool = setting(
        True,
        negate=True,
        group=COMPUTE,
        help="pack each row's whole prompt even where every row of a pass begins with the "
        "same tokens (by default, packed rows that share 16 tokens or more at their start run "
        "them once, as a prefix each row attends to: a group's prompt, few-shot examples; "
        "the log-probs and gradients are the same: trainer/packing.py)",
    )

    def __post_init__(self) -> None:
        object.__setattr__(self, "report_to", parse_report_to(self.report_to))
        check_installed(self.report_to)
        try:
            check_settings(self)
        except SettingError as exc:
            raise TrainerConfigError(str(exc)) from None
        self._check_agents()
        if not (Path(self.model_dir) / "config.json").is_file():
            raise TrainerConfigError(
                f"--model {self.model_dir!r} is not a transformers model directory "
                "(no config.json): pass 'tiny', 'smol' or the path of a local model directory"
            )
        if self.device.startswith("cuda"):
            import torch

            if not torch.cuda.is_available():
                raise TrainerConfigError(
                    f"--device {self.device}: this torch ({torch.__version__}) sees no CUDA "
                    "device (a CPU build, or no GPU here): train with --device cpu"
                )
        if not self.clip_low < 1:
            raise TrainerConfigError(f"--clip-low must be in [0, 1), got {self.clip_low}")
        if self.dual_clip and not self.dual_clip > 1:
            raise TrainerConfigError(
                f"--dual-clip must be > 1 (the ratio above which a negative advantage's loss "
                f"stops growing; verl's clip_ratio_c, 3 by default), or 0/none to turn it off, "
                f"got {self.dual_clip}"
            )
        # csv alone is the default (written only with --metrics); asked for beside other
        # trackers, it needs its file
        asked = self.report_to != DEFAULT_REPORT_TO
        if asked and "csv" in self.report_to and not self.metrics_path:
            raise TrainerConfigError(
                "--report-to csv writes the --metrics file: pass --metrics FILE as well"
            )
        try:
            mix = TaskMix.parse(self.task_mix)
            if not self.discover:
                mix.weights_for(self.agents)
        except ValueError as exc:
            raise TrainerConfigError(str(exc)) from None
        object.__setattr__(self, "task_mix", str(mix))
        if self.sync_rollouts:
            if self.publish_every != 1:
                raise TrainerConfigError(
                    f"--sync-rollouts publishes every step: drop --publish-every "
                    f"{self.publish_every} (or train asynchronously without --sync-rollouts)"
                )
            object.__setattr__(self, "max_staleness", 0)
        if self.dynamic_sampling:
            object.__setattr__(self, "filter_flat_groups", True)
        if self.optimizer_state == "fp8" and (self.parallel == "fsdp" or self.dtype != "float32"):
            raise TrainerConfigError(
                "--optimizer-state fp8 keeps fp32 weights' moments in a replicated trainer: "
                f"not with --parallel {self.parallel} --dtype {self.dtype} (use "
                "--optimizer-state fp32 there)"
            )
        if self.layer_chunk and self.parallel == "fsdp":
            raise TrainerConfigError(
                f"--layer-chunk {self.layer_chunk} runs a replicated trainer's layers sliced: "
                "not with --parallel fsdp, whose sharded layers run whole (drop it; "
                "--memory small leaves it 0 there)"
            )
        if self.parallel == "fsdp" and self.ray_workers < 1:
            raise TrainerConfigError(
                "--parallel fsdp shards the model over --ray-workers N ranks: pass "
                "--ray-workers 1 or more"
            )
        if self.lora_rank > 0 and importlib.util.find_spec("peft") is None:
            raise TrainerConfigError("--lora-rank needs peft: pip install 'agentarium[lora]'")

    def _check_agents(self) -> None:
        agents = tuple(dict.fromkeys(str(a) for a in self.agents))
        if self.agent:
            if agents and self.agent not in agents:
                raise TrainerConfigError(
                    f"agent {self.agent!r} and agents {list(agents)} disagree: name the agents "
                    "once (--agent NAME, repeated for several; agents: [a, b] in a config file)"
                )
            agents = agents or (self.agent,)
        if not agents:
            raise TrainerConfigError(
                "no agent to train: pass --agent NAME (repeat it for several agents, or "
                "--agent '*' for every agent of the run)"
            )
        try:
            check_name(self.run, "run")
            for agent in agents:
                if agent != EVERY_AGENT:
                    check_name(agent, "agent")
        except ValueError as exc:
            raise TrainerConfigError(str(exc)) from None
        for agent in agents:
            durable = f"trainer-{self.run}-{agent}"
            if agent != EVERY_AGENT and len(durable) > 255:
                raise TrainerConfigError(
                    f"run {self.run!r} with agent {agent!r}: the trainer's consumer name "
                    f"trainer-<run>-<agent> would be {len(durable)} characters, nats-server "
                    "allows 255: shorten the run or the agent name"
                )
        object.__setattr__(self, "agents", agents)
        one = len(agents) == 1 and agents[0] != EVERY_AGENT
        object.__setattr__(self, "agent", agents[0] if one else "")

    @property
    def discover(self) -> bool:
        """``--agent '*'``: the agents are found when the trainer starts."""
        return EVERY_AGENT in self.agents

    @property
    def named_agents(self) -> tuple[str, ...]:
        """The agents named explicitly (beside a '*')."""
        return tuple(a for a in self.agents if a != EVERY_AGENT)

    @property
    def mix(self) -> TaskMix:
        return TaskMix.parse(self.task_mix)

    @property
    def label(self) -> str:
        """One name for what this trainer trains: the agent, ``a+b`` for several, ``all`` for
        '*' (tracker run names, log lines)."""
        return "all" if self.discover else "+".join(self.agents)

    @property
    def max_ack_pending(self) -> int:
        """Unacked trajectories each agent's consumer may hold: a full buffer of partial groups plus a
        checkpoint interval's worth of trained-but-unacked ones, doubled for late stragglers.
        Below that, partial groups would block delivery of their own missing members."""
        buffer = 4 * self.groups_per_step * self.group_size
        held = (self.checkpoint_every + 1) * self.groups_per_step * self.group_size
        return 2 * (buffer + held) + 1024

    def tracker_path(self) -> Path:
        """Where TensorBoard, W&B and MLflow write: ``tracker_dir``, else the metrics CSV's
        directory, else the checkpoint directory, else ``./runs/<run>``."""
        if self.tracker_dir:
            return Path(self.tracker_dir)
        if self.metrics_path:
            return Path(self.metrics_path).parent
        return Path(self.checkpoint_dir or Path("runs") / self.run)

    def to_log(self) -> dict[str, Any]:
        out = asdict(self)
        out["max_ack_pending"] = self.max_ack_pending
        return out
