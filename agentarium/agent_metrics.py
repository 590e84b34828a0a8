"""Rollout metrics per agent and overall: reward, success, pass@k, failures, turns, tokens, latency.

Rewards, success and pass@k count ``ok`` trajectories only: ``error`` and ``timeout`` are
infrastructure failures (docs/design.md), reported as their own counts and rates, never as
reward 0. A rollout succeeds when its reward is at least ``success_threshold``. pass@k is the
unbiased estimator 1 - C(n-c, k) / C(n, k) over each task's n ok samples with c successes,
averaged over tasks that have at least k ok samples; it is reported for k = 1 and for k = the
largest group size.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Iterable, Sequence

from agentarium.schemas import Trajectory

PERCENTILES = (50, 90, 99)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of k samples drawn from n (c correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _mean(values: Sequence[float]) -> float:
    return float(statistics.fmean(values)) if values else 0.0


def _std(values: Sequence[float]) -> float:
    return float(statistics.pstdev(values)) if len(values) > 1 else 0.0


def summarize(
    trajectories: Sequence[Trajectory], *, success_threshold: float = 1.0
) -> dict[str, float]:
    """The metrics of one set of trajectories (one agent, or all of them)."""
    n = len(trajectories)
    ok = [t for t in trajectories if t.status == "ok"]
    rewards: list[float] = []
    for t in ok:
        assert t.reward is not None, "status ok implies a reward (Trajectory.__post_init__)"
        rewards.append(float(t.reward))
    successes = [r >= success_threshold for r in rewards]
    out: dict[str, float] = {
        "rollouts": float(n),
        "ok": float(len(ok)),
        "errors": float(sum(t.status == "error" for t in trajectories)),
        "timeouts": float(sum(t.status == "timeout" for t in trajectories)),
        "reward_mean": _mean(rewards),
        "reward_std": _std(rewards),
        "reward_min": min(rewards) if rewards else 0.0,
        "reward_max": max(rewards) if rewards else 0.0,
        "success_rate": _mean([float(s) for s in successes]),
    }
    out["error_rate"] = out["errors"] / n if n else 0.0
    out["timeout_rate"] = out["timeouts"] / n if n else 0.0

    groups: dict[str, list[bool]] = defaultdict(list)
    for t, success in zip(ok, successes, strict=True):
        groups[t.group_id].append(success)
    k_max = max((t.group_size for t in trajectories), default=1)
    for k in sorted({1, k_max}):
        scored = [pass_at_k(len(g), sum(g), k) for g in groups.values() if len(g) >= k]
        out[f"pass@{k}"] = _mean(scored)
    if k_max > 1:
        out["best_of_k"] = out[f"pass@{k_max}"]

    turns = [len(t.calls) for t in trajectories]
    response_tokens = [sum(len(c.response_ids) for c in t.calls) for t in trajectories]
    prompt_tokens = [len(t.calls[0].prompt_ids) if t.calls else 0 for t in trajectories]
    out["turns_mean"] = _mean(turns)
    out["turns_max"] = float(max(turns, default=0))
    out["response_tokens_mean"] = _mean(response_tokens)
    out["response_tokens_total"] = float(sum(response_tokens))
    out["prompt_tokens_mean"] = _mean(prompt_tokens)
    latencies = [max(0.0, t.finished_at - t.started_at) for t in trajectories if t.finished_at]
    call_latencies = [c.latency_s for t in trajectories for c in t.calls]
    for q in PERCENTILES:
        out[f"latency_p{q}_s"] = percentile(latencies, q)
        out[f"llm_latency_p{q}_s"] = percentile(call_latencies, q)
    return out


def agent_metrics(
    trajectories: Iterable[Trajectory], *, success_threshold: float = 1.0, prefix: str = ""
) -> dict[str, float]:
    """Flat ``{prefix}{agent}/{metric}`` and ``{prefix}overall/{metric}`` for logging."""
    every = list(trajectories)
    by_agent: dict[str, list[Trajectory]] = defaultdict(list)
    for t in every:
        by_agent[t.agent].append(t)
    out: dict[str, float] = {}
    for agent in sorted(by_agent):
        for key, value in summarize(by_agent[agent], success_threshold=success_threshold).items():
            out[f"{prefix}{agent}/{key}"] = value
    for key, value in summarize(every, success_threshold=success_threshold).items():
        out[f"{prefix}overall/{key}"] = value
    return out
