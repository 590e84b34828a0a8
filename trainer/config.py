"""TrainerConfig: every setting of the asynchronous GRPO trainer, validated once at the edge."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from schemas import check_name

from .errors import TrainerConfigError
from .mix import TaskMix
from .rows import MULTI_TURN
from .trackers import check_installed, parse_report_to

LOSS_AGGS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
STALE_POLICIES = ("drop", "tis")
DEVICES = ("cpu", "cuda")
TASK_ADV_NORMS = ("none", "token", "trajectory")
EVERY_AGENT = "*"  # --agent '*': every agent of the run (trainer/tasks.py, discover_agents)


@dataclass(frozen=True, kw_only=True)
class TrainerConfig:
    """Settings of one trainer process; the CLI flags map one to one onto these fields."""

    run: str
    # The agents (tasks) trained: `agents` (--agent, repeatable; '*' = every agent of the run);
    # `agent` is the one-agent spelling, kept for config files and callers that name one.
    # After validation `agents` always holds them and `agent` is set only for exactly one.
    agent: str = ""
    agents: tuple[str, ...] = ()
    model_dir: str
    # several agents: how each step's groups are shared (trainer/mix.py), how long a step
    # waits for a short task, and the optional per-task advantage normalisation (grpo.py)
    task_mix: str = "proportional"
    task_wait_s: float = 30.0
    task_adv_norm: str = "none"
    success_threshold: float = 1.0  # a trajectory succeeds when reward >= this (metrics)
    # batch shape
    group_size: int = 8  # G: expected members per group (groups complete at their own group_size)
    groups_per_step: int = 16  # B: groups per optimizer step
    micro_batch_size: int = 0  # rows per forward/backward; 0 = the whole (shard of the) batch
    # optimisation
    lr: float = 1e-5
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    grad_clip: float = 1.0
    seed: int = 0
    # GRPO loss
    clip_low: float = 0.2
    clip_high: float = 0.2
    # dual-clip: for A < 0 the loss is capped at -A * dual_clip (verl's clip_ratio_c); 0 or None
    # turns it off
    dual_clip: float | None = 3.0
    kl_coef: float = 0.0
    entropy_coef: float = 0.0  # a bonus on the policy entropy of model tokens (not textbook GRPO)
    bf16_autocast: bool = False  # forward passes in bf16 (GPUs); weights and Adam stay fp32
    loss_agg: str = "token-mean"
    loss_norm_tokens: int = 1024  # the constant divisor of seq-mean-token-sum-norm (Dr. GRPO)
    std_norm: bool = True
    adv_eps: float = 1e-6  # >= 0; a flat group has zero advantages whatever it is
    multi_turn: str = "concat"
    # off-policy control and group buffering
    max_staleness: int = 4
    stale_policy: str = "drop"
    # synchronous training (the baseline asynchronous RL is measured against): every step trains
    # only trajectories of the current version (max_staleness is set to 0), publishes, and waits
    # until the run's engines serve the new version before it takes the next batch
    sync_rollouts: bool = False
    tis_clip: float = 2.0
    filter_flat_groups: bool = False
    group_timeout_s: float = 600.0
    min_group_members: int = 2
    ack_wait_s: float = 300.0
    # outputs
    publish_every: int = 1
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    keep_checkpoints: int = 3
    metrics_path: str | None = None
    # experiment trackers, any of csv (the metrics_path file), tensorboard, wandb, mlflow; a
    # comma-separated string or a list is accepted and normalised to a tuple
    report_to: tuple[str, ...] = ("csv",)
    tracker_dir: str | None = None  # where trackers write; see tracker_path()
    device: str = "cpu"
    ray_workers: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "report_to", parse_report_to(self.report_to))
        check_installed(self.report_to)
        self._check_agents()
        if not (Path(self.model_dir) / "config.json").is_file():
            raise TrainerConfigError(
                f"--model {self.model_dir!r} is not a transformers model directory "
                "(no config.json): pass 'tiny' or the path of a local model directory"
            )
        _positive(self, "group_size", "groups_per_step", "publish_every", "checkpoint_every")
        _positive(self, "keep_checkpoints", "loss_norm_tokens", "tis_clip", "ack_wait_s")
        _positive(self, "group_timeout_s")
        _at_least(
            self, 0, "micro_batch_size", "max_staleness", "ray_workers", "kl_coef", "entropy_coef"
        )
        _at_least(self, 0, "weight_decay", "grad_clip", "lr", "adv_eps")
        if self.min_group_members < 2:
            raise TrainerConfigError(
                "min_group_members must be >= 2: a group of one has advantage 0 and teaches nothing"
            )
        if not 0 <= self.clip_low < 1:
            raise TrainerConfigError(f"--clip-low must be in [0, 1), got {self.clip_low}")
        if self.clip_high < 0:
            raise TrainerConfigError(f"--clip-high must be >= 0, got {self.clip_high}")
        if self.dual_clip and not self.dual_clip > 1:
            raise TrainerConfigError(
                f"--dual-clip must be > 1 (the ratio above which a negative advantage's loss "
                f"stops growing; verl's clip_ratio_c, 3 by default), or 0/none to turn it off, "
                f"got {self.dual_clip}"
            )
        _choice(self, "loss_agg", LOSS_AGGS, "--loss-agg")
        _choice(self, "stale_policy", STALE_POLICIES, "--stale-policy")
        _choice(self, "multi_turn", MULTI_TURN, "--multi-turn")
        _choice(self, "device", DEVICES, "--device")
        _choice(self, "task_adv_norm", TASK_ADV_NORMS, "--task-adv-norm")
        _at_least(self, 0, "task_wait_s")
        try:
            mix = TaskMix.parse(self.task_mix)
            if not self.discover:
                mix.weights_for(self.agents)
        except ValueError as exc:
            raise TrainerConfigError(str(exc)) from None
        object.__setattr__(self, "task_mix", str(mix))
        if self.ack_wait_s < 3:
            raise TrainerConfigError("ack_wait_s must be >= 3 (heartbeats go every third of it)")
        if self.sync_rollouts:
            if self.publish_every != 1:
                raise TrainerConfigError(
                    f"--sync-rollouts publishes every step: drop --publish-every "
                    f"{self.publish_every} (or train asynchronously without --sync-rollouts)"
                )
            object.__setattr__(self, "max_staleness", 0)

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


def _positive(config: TrainerConfig, *names: str) -> None:
    for name in names:
        if not getattr(config, name) > 0:
            raise TrainerConfigError(f"{_flag(name)} must be > 0, got {getattr(config, name)}")


def _at_least(config: TrainerConfig, low: float, *names: str) -> None:
    for name in names:
        if getattr(config, name) < low:
            raise TrainerConfigError(f"{_flag(name)} must be >= {low}, got {getattr(config, name)}")


def _choice(config: TrainerConfig, name: str, allowed: tuple[str, ...], flag: str) -> None:
    if getattr(config, name) not in allowed:
        raise TrainerConfigError(
            f"{flag} {getattr(config, name)!r} is not one of {', '.join(allowed)}"
        )


def _flag(name: str) -> str:
    """The flag of a field: durations in seconds drop their ``_s`` (``--task-wait``)."""
    return "--" + name.removesuffix("_s").replace("_", "-")
