"""A step's report: its metrics row, its span and its log line, built in one place.

The loop trains; what it says about a step (StepMetrics for the CSV, trackers and /metrics,
the ``train step`` span linking every rollout span it used, the "step done" log line) is
assembled here from the step's groups, the updater's StepStats and the collector's counters.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import structlog
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN_ID, Link, Span, SpanContext, TraceFlags

from agentarium.broker import OPENINFERENCE_SPAN_KIND, extract_context

from .batch import BuildStats
from .groups import BufferCounters, Group
from .live import LiveMetrics
from .metrics import MetricsSink, StepMetrics, TaskMetrics
from .prometheus import record_step
from .step import StepStats
from .tasks import TaskCollector

log = structlog.get_logger("agentarium.trainer")
tracer = trace.get_tracer("agentarium.trainer")

LINKS_PER_SPAN = 4096  # broker.telemetry raises the SDK's default of 128 to this


class StepReporter:
    """Where each step's row goes: the CSV and trackers (MetricsSink), /metrics (Prometheus)
    and the live stream (<p>.metrics.<run>)."""

    def __init__(self, sink: MetricsSink, live: LiveMetrics, *, run: str) -> None:
        self.sink = sink
        self.live = live
        self.run = run

    async def __call__(self, row: StepMetrics, groups: list[Group]) -> None:
        self.sink.record(row)
        record_step(self.run, row, trajectories=sum(len(g.samples) for g in groups))
        await self.live.publish(row)


@contextmanager
def step_span(groups: list[Group]) -> Iterator[Span]:
    """The ``train step`` span, linked to the rollout span of every trajectory used; past
    one span's limit, child spans carry the rest of the links."""
    links = _links(groups)
    chain = {OPENINFERENCE_SPAN_KIND: "CHAIN"}
    with tracer.start_as_current_span(
        "train step", links=links[:LINKS_PER_SPAN], attributes=chain
    ) as span:
        for start in range(LINKS_PER_SPAN, len(links), LINKS_PER_SPAN):
            chunk = links[start : start + LINKS_PER_SPAN]
            with tracer.start_as_current_span("train step links", links=chunk, attributes=chain):
                pass
        yield span


class ReceivedRewards:
    """The policy's reward between two steps: the mean over the ok trajectories a buffer took
    in since the last ``take`` (``BufferCounters.ok_received``, ``reward_received``), whatever
    became of them; None when none arrived. One per trainer, keyed by task ("" for all)."""

    def __init__(self) -> None:
        self._marks: dict[str, tuple[int, float]] = {}

    def take(self, key: str, counters: BufferCounters) -> float | None:
        count, total = self._marks.get(key, (0, 0.0))
        self._marks[key] = (counters.ok_received, counters.reward_received)
        if counters.ok_received <= count:
            return None
        return (counters.reward_received - total) / (counters.ok_received - count)


def step_metrics(
    groups: list[Group],
    stats: StepStats,
    built: BuildStats,
    collector: TaskCollector,
    *,
    received: ReceivedRewards,
    step: int,
    version: int,
    step_s: float,
    wait_s: float,
    success_threshold: float,
    drawn: Mapping[str, int] | None = None,
    stale_policy: str = "drop",
) -> StepMetrics:
    """The metrics row of one step (``drawn``: replacement groups per agent, dynamic
    sampling's). Staleness is per token: the oldest token's and the mean over tokens, each by
    its own version (a trajectory without a generated token counts by its calls' version)."""
    drawn = drawn or {}
    rewards = _rewards(groups)
    staleness = [x for g in groups for x in g.staleness]
    tokens: Counter[int] = Counter()
    for g in groups:
        tokens.update(g.token_staleness)
    count = sum(tokens.values())
    if count:
        mean = math.fsum(s * n for s, n in tokens.items()) / count
    else:
        mean = statistics.fmean(staleness) if staleness else 0.0
    c = collector.counters
    return StepMetrics(
        step=step,
        version=version,
        reward_mean_received=received.take("", c),
        reward_mean_trained=statistics.fmean(rewards) if rewards else 0.0,
        reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        loss=stats.loss,
        kl=stats.kl,
        clip_frac=stats.clip_frac,
        entropy=stats.entropy,
        tokens=stats.tokens,
        tokens_per_s=stats.tokens / step_s if step_s > 0 else 0.0,
        step_s=step_s,
        groups_used=len(groups),
        dropped_stale=c.dropped_stale,
        dropped_flat=c.dropped_flat,
        staleness_max=max([*staleness, *tokens], default=0),
        staleness_mean=mean,
        staleness_hist=collector.staleness_histogram(groups),
        model_tokens=stats.model_tokens,
        rows=stats.rows,
        grad_norm=stats.grad_norm,
        ratio_mean=stats.ratio_mean,
        wait_s=wait_s,
        tis_weighted=c.tis_weighted,
        prefix_mismatches=built.prefix_mismatches,
        multi_turn_rows=built.concatenated,
        failed_members=c.failed_members,
        refused=c.refused,
        validation_skipped=c.validation_skipped,
        drawn=sum(drawn.values()),
        overlong=c.overlong_filtered + c.overlong_rewarded,
        stale_masked=c.stale_masked,
        foreign_weights=c.foreign_weights,
        stale_policy=stale_policy,
        tasks=task_metrics(groups, collector, success_threshold, drawn, received),
        rollout=rollout_metrics(groups),
    )


def rollout_metrics(groups: list[Group]) -> dict[str, float]:
    """Each of the agents' own metrics (``Trajectory.metrics``: tool calls, turns, ...), the
    mean over the step's trained trajectories that report it."""
    values: dict[str, list[float]] = {}
    for g in groups:
        for s in g.samples:
            for name, value in (s.trajectory.metrics or {}).items():
                values.setdefault(name, []).append(float(value))
    return {name: math.fsum(v) / len(v) for name, v in values.items()}


def task_metrics(
    groups: list[Group],
    collector: TaskCollector,
    success_threshold: float,
    drawn: Mapping[str, int] | None = None,
    received: ReceivedRewards | None = None,
) -> dict[str, TaskMetrics]:
    """Each agent's share of a step: its groups, rewards, success rate and lengths."""
    out: dict[str, TaskMetrics] = {}
    for agent, counters in collector.task_counters.items():
        mine = [g for g in groups if g.task == agent]
        rewards = _rewards(mine)
        lengths = [
            sum(len(call.response_ids) for call in s.trajectory.calls)
            for g in mine
            for s in g.samples
        ]
        out[agent] = TaskMetrics(
            groups=len(mine),
            trajectories=len(rewards),
            reward_mean_received=received.take(agent, counters) if received else None,
            reward_mean_trained=statistics.fmean(rewards) if rewards else None,
            success=statistics.fmean(r >= success_threshold for r in rewards) if rewards else None,
            length=statistics.fmean(lengths) if lengths else None,
            dropped_stale=counters.dropped_stale,
            dropped_groups=counters.dropped_groups,
            drawn=(drawn or {}).get(agent, 0),
        )
    return out


def span_attributes(run: str, row: StepMetrics, trajectories: int) -> dict[str, Any]:
    """What the ``train step`` span records of its step."""
    return {
        "agentarium.run": run,
        "agentarium.step": row.step,
        "agentarium.version": row.version,
        "agentarium.groups": row.groups_used,
        "agentarium.trajectories": trajectories,
        "agentarium.tokens": row.tokens,
        "agentarium.loss": row.loss,
        "agentarium.reward_mean_trained": row.reward_mean_trained,
        **(
            {"agentarium.reward_mean_received": row.reward_mean_received}
            if row.reward_mean_received is not None
            else {}
        ),
    }


def log_step(row: StepMetrics) -> None:
    """The one "step done" line of a step."""
    by_task = {a: t.groups for a, t in row.tasks.items()}
    log.info(
        "step done",
        step=row.step,
        version=row.version,
        reward_mean_received=_round(row.reward_mean_received),
        reward_mean_trained=round(row.reward_mean_trained, 4),
        loss=round(row.loss, 6),
        groups=row.groups_used,
        tokens=row.tokens,
        step_s=round(row.step_s, 3),
        dropped_stale=row.dropped_stale,
        **({"stale_masked": row.stale_masked} if row.stale_masked else {}),
        **({"foreign_weights": row.foreign_weights} if row.foreign_weights else {}),
        **({"drawn": row.drawn} if row.drawn else {}),
        **({"groups_by_task": by_task} if len(by_task) > 1 else {}),
    )


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _rewards(groups: list[Group]) -> list[float]:
    rewards = []
    for s in (s for g in groups for s in g.samples):  # trainable (status ok) members only
        assert s.trajectory.reward is not None, "status ok implies a reward (Trajectory)"
        rewards.append(float(s.trajectory.reward))
    return rewards


def _links(groups: list[Group]) -> list[Link]:
    """One link per used trajectory, to the ``rollout`` span that produced it: the trajectory
    keeps that span's trace and span ids. A trajectory without a span id (from a writer older
    than the field) is linked to the span of a ``traceparent`` its message carries, else to
    its trace alone, with span id zero: the spec lets such a link be recorded since it has
    attributes, but a viewer cannot follow it to a span."""
    links = []
    for group in groups:
        for sample in group.samples:
            traj = sample.trajectory
            attrs = {"agentarium.job_id": traj.job_id, "agentarium.group_id": traj.group_id}
            trace_id, span_id = _hex_id(traj.trace_id, 32), _hex_id(traj.span_id, 16)
            if trace_id and span_id:
                flags = TraceFlags(TraceFlags.SAMPLED)
                links.append(Link(SpanContext(trace_id, span_id, True, flags), attrs))
                continue
            member = group.members.get(traj.job_id)
            headers = getattr(getattr(member, "handle", None), "headers", None) or {}
            parent = trace.get_current_span(extract_context(headers)).get_span_context()
            if parent.is_valid:
                links.append(Link(parent, attrs))
            elif trace_id:
                ctx = SpanContext(
                    trace_id,
                    INVALID_SPAN_ID,
                    is_remote=True,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED),
                )
                links.append(Link(ctx, attrs))
    return links


def _hex_id(text: str, digits: int) -> int:
    """A trace (32) or span (16) id from its hex digits; 0, the invalid id, for anything else."""
    if len(text) != digits:
        return 0
    try:
        return int(text, 16)
    except ValueError:
        return 0
