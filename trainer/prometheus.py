"""The trainer's Prometheus metrics (the weight syncer's are inference/sync/metrics.py).

Defined once per process on the default registry, which ``agentarium trainer --metrics-port``
serves (broker.MetricsServer). Labels: the run, an engine
URL, a reason or result from a fixed list. The per-step values are the CSV's (trainer/metrics.py)
under Prometheus names; the drop counters are read live from the group buffer at each scrape,
so a drop shows before the next step does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from .metrics import StepMetrics

if TYPE_CHECKING:  # groups.py loads torch; only a training process needs it
    from .groups import BufferCounters

STEP_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16, 32)

STEP = Gauge("agentarium_trainer_step", "Last optimizer step (counted across resumes)", ["run"])
STEPS = Counter("agentarium_trainer_steps", "Optimizer steps taken by this process", ["run"])
VERSION = Gauge(
    "agentarium_trainer_policy_version",
    "Policy version the last step's data was judged against (its update is published as the next)",
    ["run"],
)
TOKENS = Counter("agentarium_trainer_tokens", "Tokens in trained batches (prompts too)", ["run"])
TRAJECTORIES = Counter("agentarium_trainer_trajectories", "Trajectories trained on", ["run"])
STEP_SECONDS = Histogram(
    "agentarium_trainer_step_duration_seconds",
    "Batch building and the update of one step (not the wait for data)",
    ["run"],
    buckets=STEP_BUCKETS,
)
WAIT_SECONDS = Histogram(
    "agentarium_trainer_data_wait_seconds",
    "Time a step waited for enough complete groups",
    ["run"],
    buckets=STEP_BUCKETS,
)
STALENESS = Histogram(
    "agentarium_trainer_staleness_versions",
    "Policy versions between each weighed trajectory and the trainer",
    ["run"],
    buckets=STALENESS_BUCKETS,
)
PUBLISH_SECONDS = Histogram(
    "agentarium_trainer_publish_duration_seconds",
    "Saving, storing and announcing one policy version",
    ["run"],
    buckets=STEP_BUCKETS,
)
CHECKPOINT_SECONDS = Histogram(
    "agentarium_trainer_checkpoint_duration_seconds",
    "Writing one checkpoint",
    ["run"],
    buckets=STEP_BUCKETS,
)
# StepMetrics field -> (gauge name, help)
STEP_GAUGES = {
    "reward_mean_received": (
        "agentarium_trainer_reward_mean",
        "Mean reward of the ok trajectories received before the last step (the policy's)",
    ),
    "reward_mean_trained": (
        "agentarium_trainer_reward_mean_trained",
        "Mean reward of the trajectories the last step trained on",
    ),
    "reward_std": ("agentarium_trainer_reward_std", "Reward std of the last step's trajectories"),
    "loss": ("agentarium_trainer_loss", "GRPO loss of the last step"),
    "kl": ("agentarium_trainer_kl", "Mean k3 KL to the reference per model token"),
    "entropy": ("agentarium_trainer_entropy", "Mean policy entropy per model token (nats)"),
    "clip_frac": ("agentarium_trainer_clip_fraction", "Fraction of model tokens clipped"),
    "grad_norm": ("agentarium_trainer_grad_norm", "Gradient global norm before clipping"),
    "ratio_mean": ("agentarium_trainer_ratio_mean", "Mean importance ratio over model tokens"),
    "tokens_per_s": ("agentarium_trainer_tokens_per_second", "Tokens per second of update"),
    "staleness_max": (
        "agentarium_trainer_staleness_max_versions",
        "Oldest trajectory weighed in the last step, in versions behind",
    ),
}
GAUGES = {field: Gauge(name, doc, ["run"]) for field, (name, doc) in STEP_GAUGES.items()}

# BufferCounters field -> reason label, for trajectories and groups that never reach a gradient.
DROPPED_TRAJECTORIES = {
    "dropped_stale": "stale",
    "late": "late",
    "invalid": "invalid",
    "duplicates": "duplicate",
    "refused": "refused",
    "failed_members": "failed",
    "validation_skipped": "validation",
    "cross_only": "cross_only",
    "foreign_weights": "foreign_weights",
}
DROPPED_GROUPS = {
    "dropped_flat": "flat",
    "dropped_small": "small",
    "dropped_incomplete": "incomplete",
    "dropped_stale_groups": "stale",
}


class BufferCollector:
    """The group buffers' running totals as counters, read at each scrape."""

    def __init__(self) -> None:
        self._sources: dict[str, Callable[[], BufferCounters | None]] = {}

    def track(self, run: str, counters: Callable[[], BufferCounters | None]) -> None:
        self._sources[run] = counters

    def forget(self, run: str) -> None:
        self._sources.pop(run, None)

    def describe(self) -> list[CounterMetricFamily]:
        return list(self._families().values())

    def collect(self) -> Iterator[CounterMetricFamily]:
        families = self._families()
        for run, source in list(self._sources.items()):
            counters = source()
            if counters is None:
                continue
            for field, reason in DROPPED_TRAJECTORIES.items():
                families["trajectories"].add_metric([run, reason], getattr(counters, field))
            for field, reason in DROPPED_GROUPS.items():
                families["groups"].add_metric([run, reason], getattr(counters, field))
            families["received"].add_metric([run], counters.received)
            families["tis"].add_metric([run], counters.tis_weighted)
        yield from families.values()

    @staticmethod
    def _families() -> dict[str, CounterMetricFamily]:
        return {
            "trajectories": CounterMetricFamily(
                "agentarium_trainer_dropped_trajectories",
                "Trajectories kept out of training, by reason (stale, late, invalid, duplicate, "
                "refused sampling, failed rollout, validation, cross_only: every call "
                "cross-sampled)",
                labels=["run", "reason"],
            ),
            "groups": CounterMetricFamily(
                "agentarium_trainer_dropped_groups",
                "Groups dropped, by reason (flat rewards, too few ok members, timed out short, "
                "every member stale)",
                labels=["run", "reason"],
            ),
            "received": CounterMetricFamily(
                "agentarium_trainer_received_trajectories",
                "Trajectories the trainer received",
                labels=["run"],
            ),
            "tis": CounterMetricFamily(
                "agentarium_trainer_tis_weighted_trajectories",
                "Stale trajectories trained with truncated importance sampling",
                labels=["run"],
            ),
        }


BUFFERS = BufferCollector()
REGISTRY.register(BUFFERS)


def record_step(run: str, m: StepMetrics, trajectories: int) -> None:
    """One step's values (the trainer loop calls it next to the CSV row)."""
    STEP.labels(run).set(m.step)
    STEPS.labels(run).inc()
    VERSION.labels(run).set(m.version)
    TOKENS.labels(run).inc(m.tokens)
    TRAJECTORIES.labels(run).inc(trajectories)
    STEP_SECONDS.labels(run).observe(m.step_s)
    WAIT_SECONDS.labels(run).observe(m.wait_s)
    for field, gauge in GAUGES.items():
        value = getattr(m, field)
        if value is not None:  # none received: the gauge keeps its last value
            gauge.labels(run).set(float(value))
    staleness = STALENESS.labels(run)
    for versions, count in m.staleness_hist.items():
        for _ in range(count):
            staleness.observe(versions)
