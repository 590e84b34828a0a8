"""Cross-sampling (as in AgentRL): each LLM call of a rollout goes to a second model with
probability ``ratio``, so one trajectory mixes the two models' turns.

A backend wrapper composing two backends behind the same ``generate`` interface. Which model
served a call is recorded in the call's ``backend`` field as ``<server URL>#model=<name>``
(still a URL, so spans parse it as before); ``model_of_call`` reads it back.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from .base import GenerateRequest, GenerateResult

MODEL_TAG = "#model="


def tag(backend_url: str, model: str) -> str:
    return f"{backend_url}{MODEL_TAG}{model}"


def model_of_call(call: Any, default: str = "") -> str:
    """The model name recorded for an LLMCall (its backend tag, else its ``model`` field)."""
    backend = getattr(call, "backend", "") or ""
    if MODEL_TAG in backend:
        return backend.rsplit(MODEL_TAG, 1)[1]
    return getattr(call, "model", "") or default


class CrossSamplingBackend:
    """``primary`` serves a call with probability 1 - ratio, ``secondary`` with ``ratio``."""

    def __init__(
        self,
        primary: Any,
        secondary: Any,
        ratio: float,
        *,
        primary_name: str,
        secondary_name: str,
        seed: int | None = None,
    ) -> None:
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"cross-sampling ratio must be in [0, 1], got {ratio}")
        if primary_name == secondary_name:
            raise ValueError(
                f"both models are named {primary_name!r}: give the second one another name "
                "(--cross-model-name) so the trajectories can tell them apart"
            )
        self.primary = primary
        self.secondary = secondary
        self.ratio = ratio
        self.names = (primary_name, secondary_name)
        self.served = {primary_name: 0, secondary_name: 0}
        self._rng = random.Random(seed)

    @property
    def provider_name(self) -> str:
        """The API both models speak; the primary's when they differ (known before a call)."""
        return str(getattr(self.primary, "provider_name", "") or "unknown")

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        second = self._rng.random() < self.ratio
        backend = self.secondary if second else self.primary
        name = self.names[1 if second else 0]
        result = await backend.generate(request)
        self.served[name] += 1
        return replace(result, backend=tag(result.backend, name))

    async def aclose(self) -> None:
        for backend in (self.primary, self.secondary):
            close = getattr(backend, "aclose", None)
            if close is not None:
                await close()

    def __repr__(self) -> str:
        return f"CrossSamplingBackend({self.names[0]} / {self.names[1]} at {self.ratio:g}, served={self.served})"
