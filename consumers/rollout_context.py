"""The running rollout, as its agent's code sees it: the job's id, attempt and deadline, and
notes that join the trajectory's ``metadata``.

The rollout sets it (``entered``) around the start of the agent's task, which copies the
context, so the agent (and any thread a sync agent runs in) reads it with ``current()``. A
program agent (consumers/agents/program.py) names its working directory after the job and keeps its
program's output in ``notes["program"]``, which the trajectory holds even when the rollout
times out. Outside a rollout (an agent called directly) ``current()`` is a context of its own
whose notes go nowhere.
"""

from __future__ import annotations

import contextvars
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field


@dataclass(frozen=True, kw_only=True)
class RolloutContext:
    job_id: str = "rollout"
    attempt: int = 1
    deadline_s: float | None = None
    notes: dict = field(default_factory=dict)  # added to the trajectory's metadata


_CURRENT: contextvars.ContextVar[RolloutContext | None] = contextvars.ContextVar(
    "agentarium_rollout", default=None
)


def current() -> RolloutContext:
    """The rollout this code runs in, or a fresh context outside any."""
    return _CURRENT.get() or RolloutContext()


@contextmanager
def entered(context: RolloutContext) -> Iterator[RolloutContext]:
    """``context`` is current inside the block (and in the tasks started there)."""
    token = _CURRENT.set(context)
    try:
        yield context
    finally:
        _CURRENT.reset(token)
