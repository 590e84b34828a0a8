"""The task mix: how one step's B groups are shared between the agents (tasks) a trainer trains.

Pure rules, no NATS (the multi-agent collector, trainer/tasks.py, applies them). ``--task-mix``:

- ``proportional`` (default): the B oldest ready groups whatever their task (oldest policy
  version first, then first arrival), so each task's share follows the rate at which its
  groups complete. No task is ever waited for; with one agent this is exactly what a one-agent
  trainer does.
- ``balanced``: every task weighs the same.
- ``a=0.7,b=0.3``: weights, one per trained agent, normalised to sum 1.

**Quotas** (weighted mixes): task t gets floor(B w_t) groups; the leftover slots (fewer than
the number of tasks) go one each to the tasks furthest behind their share of every group this
trainer took so far (deficit = w_t · (taken + B) − (taken_t + floor(B w_t)), ties in agent
order). So a B smaller than the number of tasks still rotates through every task, and the
long-run shares converge on the weights (a=0.7,b=0.3 with B = 4 takes 3+1, 3+1, 2+2, ...).

**Slow tasks.** A step waits until every task has its quota ready, but for at most
``task_wait_s`` from the start of the wait. After that it takes what each short task has and
hands the shortfall to the tasks that have more ready, in proportion to their weights (capped by
what they have), and then needs only B groups in total, as a one-agent trainer does. So a task
whose trajectories stop arriving delays each step by at most ``task_wait_s`` (every step waits
that long again: a task that recovers is never given up on), and its share goes to the others;
a task that was short gets at most one extra group a step afterwards (the leftover slot, when
B w_t is not whole), so the mix is not rebalanced by a burst of its backlog. Staleness is judged
per group whatever its task, so a slow task's groups are dropped by the same rule as anyone's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agentarium.schemas import check_name

PROPORTIONAL, BALANCED, WEIGHTS = "proportional", "balanced", "weights"


@dataclass(frozen=True)
class TaskMix:
    """A parsed ``--task-mix``: ``kind`` and, for ``weights``, each agent's weight as given."""

    kind: str = PROPORTIONAL
    weights: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def parse(cls, text: str) -> TaskMix:
        """``proportional``, ``balanced`` or ``a=0.7,b=0.3``; a ValueError says what to write."""
        text = str(text).strip()
        if text in (PROPORTIONAL, BALANCED):
            return cls(text)
        weights: dict[str, float] = {}
        for part in text.split(","):
            name, sep, value = part.partition("=")
            name = name.strip()
            if not sep:
                raise ValueError(
                    f"--task-mix {text!r}: write proportional, balanced, or weights per agent "
                    "such as a=0.7,b=0.3"
                )
            check_name(name, "agent")
            if name in weights:
                raise ValueError(f"--task-mix {text!r}: agent {name} is weighted twice")
            try:
                weight = float(value)
            except ValueError:
                raise ValueError(
                    f"--task-mix {text!r}: the weight of {name} must be a number, got {value!r}"
                ) from None
            if not (weight > 0 and math.isfinite(weight)):
                raise ValueError(
                    f"--task-mix {text!r}: the weight of {name} must be > 0 (leave an agent "
                    "out of --agent rather than giving it no share)"
                )
            weights[name] = weight
        return cls(WEIGHTS, weights)

    def __str__(self) -> str:
        if self.kind != WEIGHTS:
            return self.kind
        return ",".join(f"{name}={weight:g}" for name, weight in self.weights.items())

    def weights_for(self, agents: Sequence[str]) -> dict[str, float] | None:
        """Each agent's normalised weight (None for proportional); weights must name exactly
        the trained agents."""
        if self.kind == PROPORTIONAL:
            return None
        if self.kind == BALANCED:
            return {agent: 1 / len(agents) for agent in agents}
        missing = [a for a in agents if a not in self.weights]
        extra = [a for a in self.weights if a not in agents]
        if missing or extra:
            problems = []
            if missing:
                problems.append(f"no weight for {', '.join(missing)}")
            if extra:
                problems.append(f"{', '.join(extra)} not trained (not in --agent)")
            raise ValueError(
                f"--task-mix {self}: {'; '.join(problems)}: weigh every trained agent, e.g. "
                + ",".join(f"{a}=1" for a in agents)
            )
        total = sum(self.weights[a] for a in agents)
        return {a: self.weights[a] / total for a in agents}


def quotas(n: int, weights: Mapping[str, float], taken: Mapping[str, int]) -> dict[str, int]:
    """Each task's share of a step of n groups (the module docstring's rule); ``taken``: groups
    each task had in the steps so far."""
    agents = list(weights)
    base = {a: math.floor(n * weights[a] + 1e-9) for a in agents}
    left = n - sum(base.values())
    after = sum(taken.get(a, 0) for a in agents) + n

    def deficit(a: str) -> float:
        return round(weights[a] * after - taken.get(a, 0) - base[a], 9)

    for a in sorted(agents, key=lambda a: (-deficit(a), agents.index(a)))[:left]:
        base[a] += 1
    return base


def apportion(n: int, weights: Mapping[str, float]) -> dict[str, int]:
    """n slots in proportion to ``weights`` (largest remainder, ties in key order)."""
    total = sum(weights.values())
    exact = {a: n * w / total for a, w in weights.items()}
    out = {a: math.floor(x + 1e-9) for a, x in exact.items()}
    order = list(weights)
    by_remainder = sorted(order, key=lambda a: (-round(exact[a] - out[a], 9), order.index(a)))
    for a in by_remainder[: n - sum(out.values())]:
        out[a] += 1
    return out


def compose(
    n: int,
    ready: Mapping[str, Sequence[Any]],
    *,
    weights: Mapping[str, float] | None,
    taken: Mapping[str, int] | None = None,
    waited_out: bool = False,
) -> dict[str, int] | None:
    """How many of each task's ready groups a step of n takes, or None to wait for more.

    ``ready[t]`` lists task t's usable groups oldest first, as sort keys (proportional merges
    them by key); ``weights`` is None for proportional; ``waited_out``: ``task_wait_s`` has
    passed since the step started waiting.
    """
    available = {t: len(keys) for t, keys in ready.items()}
    if weights is None:
        if sum(available.values()) < n:
            return None
        merged = sorted(
            ((key, i, t) for t, keys in ready.items() for i, key in enumerate(keys)),
            key=lambda item: (item[0], item[1], list(ready).index(item[2])),
        )
        counts = dict.fromkeys(ready, 0)
        for _, _, t in merged[:n]:
            counts[t] += 1
        return counts
    want = quotas(n, weights, taken or {})
    if all(available.get(t, 0) >= k for t, k in want.items()):
        return want
    if not waited_out or sum(available.get(t, 0) for t in weights) < n:
        return None
    take = {t: min(k, available.get(t, 0)) for t, k in want.items()}
    short = n - sum(take.values())
    while short > 0:
        spare = {t: available.get(t, 0) - take[t] for t in weights}
        spare = {t: s for t, s in spare.items() if s > 0}
        give = apportion(short, {t: weights[t] for t in spare})
        for t, extra in give.items():
            extra = min(extra, spare[t])
            take[t] += extra
            short -= extra
    return take
