"""The environment interface: one class per kind of environment, one instance per session.

An environment is function-call based, so one agent loop serves every task: ``reset`` shows
chat messages and OpenAI-style tools, ``step`` takes the assistant's message (its
``tool_calls``) and answers with tool results, ``close`` scores the episode. The worker
(``agentarium env serve``) creates one instance per session and calls these methods; it never
lets an exception from them escape (the session is closed with a failure outcome instead).
"""

from __future__ import annotations

import inspect
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from agentarium.schemas import Observation, SessionOutcome, StepResult


class Environment(ABC):
    """Subclass this; the worker builds it with ``cls()`` (or ``cls(**options)``) per session."""

    #: the default service name (``agentarium env serve module:Class`` takes it unless --name)
    name: str = ""

    @abstractmethod
    async def reset(self, task: dict) -> Observation:
        """Start the episode for ``task`` (inline data, or ``{"index": id}`` of ``indices()``)."""

    @abstractmethod
    async def step(self, action: dict) -> StepResult:
        """Run the assistant message ``action`` (``content`` and ``tool_calls``)."""

    @abstractmethod
    async def close(self) -> SessionOutcome:
        """End the episode and score it; release every resource. Called exactly once."""

    @classmethod
    def indices(cls) -> list[str]:
        """The ids of the tasks this environment ships (``{"index": id}`` tasks); [] if none."""
        return []

    @classmethod
    def preflight(cls, options: dict[str, Any]) -> None:
        """Called once as a worker starts serving this class, with the options every session is
        built with: refuse a host that cannot serve it (raise ``ValueError`` saying what to do),
        and clean what a crashed worker left. The default does nothing."""
        return None

    @classmethod
    def overall(cls, outcomes: Sequence[SessionOutcome]) -> dict[str, float] | None:
        """An optional overall score over many episodes (default: the mean score)."""
        if not outcomes:
            return None
        return {"score": sum(o.score for o in outcomes) / len(outcomes)}


def check_options(env_cls: type[Environment], options: dict[str, Any]) -> dict[str, Any]:
    """``options`` if ``env_cls(**options)`` can be called, else a ValueError naming them."""
    try:
        inspect.signature(env_cls).bind(**options)
    except TypeError as exc:
        raise ValueError(
            f"{env_cls.__qualname__} does not take the options {sorted(options)}: {exc}"
        ) from None
    return dict(options)
