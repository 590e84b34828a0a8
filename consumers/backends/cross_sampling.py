"""Cross-sampling (as in AgentRL): each LLM call of a rollout goes to a second model with
probability ``ratio``, so one trajectory mixes the two models' turns.

A backend wrapper composing two backends behind the same ``generate`` interface, used by
evaluation (``eval run --cross-model``) and by training rollouts (``consumer --cross-model``).
Each result says who generated it: ``model`` (the primary's or the second model's name) and
``policy`` (false for the second model), which the tracing client records in the ``LLMCall``;
a trainer keeps the second model's tokens as context and never trains on them.

The second model is sent the policy's prompt token ids, so it must share the policy's
tokenizer: ``check_same_tokenizer`` compares the two at start and refuses a mismatch.
"""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

from ..errors import CrossSamplingError, LLMError
from .base import GenerateRequest, GenerateResult, OnChunk, streams
from .vocab import FINGERPRINT, server_fingerprint

# Trajectories recorded before LLMCall.model named the answering model carried it here, in the
# backend URL: ``<server URL>#model=<name>``. Read back by ``model_of_call``, no longer written.
MODEL_TAG = "#model="


def model_of_call(call: Any, default: str = "") -> str:
    """The model that generated an LLMCall: its ``model`` field (or, in older records, the
    backend URL's tag), else ``default``."""
    backend = getattr(call, "backend", "") or ""
    if MODEL_TAG in backend:
        return backend.rsplit(MODEL_TAG, 1)[1]
    return getattr(call, "model", "") or default


class CrossSamplingBackend:
    """``primary`` (the policy) serves a call with probability 1 - ratio, ``secondary`` with
    ``ratio``; the coin is tossed per call."""

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

    @property
    def streams(self) -> bool:
        """Takes ``on_chunk`` when either model's backend streams: a call served by one that
        does not answers in one piece (its result, no chunk)."""
        return streams(self.primary) or streams(self.secondary)

    async def generate(
        self, request: GenerateRequest, on_chunk: OnChunk | None = None
    ) -> GenerateResult:
        second = self._rng.random() < self.ratio
        backend = self.secondary if second else self.primary
        name = self.names[1 if second else 0]
        if on_chunk is not None and streams(backend):
            result = await backend.generate(request, on_chunk)
        else:
            result = await backend.generate(request)
        self.served[name] += 1
        return replace(result, model=name, policy=not second)

    async def aclose(self) -> None:
        for backend in (self.primary, self.secondary):
            close = getattr(backend, "aclose", None)
            if close is not None:
                await close()

    def __repr__(self) -> str:
        return f"CrossSamplingBackend({self.names[0]} / {self.names[1]} at {self.ratio:g}, served={self.served})"


async def check_same_tokenizer(
    policy: Any,
    cross: Any,
    *,
    policy_name: str,
    cross_name: str,
    policy_tokenizer: str = "",
) -> None:
    """Refuse (``CrossSamplingError``) a second model that does not share the policy's tokenizer.

    Each side's tokenizer is read from its servers' ``/model_info``: the ``tokenizer_fingerprint``
    the local engine reports, else the fingerprint of its ``tokenizer_path`` when that is a
    model directory on this machine; for the policy, else the consumer's own tokenizer
    (``policy_tokenizer``, the directory that renders every prompt). Equal fingerprints pass;
    without one on a side, equal ``tokenizer_path`` strings pass; anything else is refused.
    """
    policy_info = await _model_info(policy, f"the policy {policy_name!r}")
    cross_info = await _model_info(cross, f"the cross model {cross_name!r}")
    policy_path = str(policy_info.get("tokenizer_path") or "")
    cross_path = str(cross_info.get("tokenizer_path") or "")
    policy_fp, policy_from = server_fingerprint(policy_info, policy_tokenizer)
    cross_fp, cross_from = server_fingerprint(cross_info)
    if policy_fp and cross_fp:
        if policy_fp == cross_fp:
            return
        raise CrossSamplingError(
            f"the cross model {cross_name!r} (tokenizer {cross_path or '?'}, fingerprint "
            f"{cross_fp[:12]} {cross_from}) does not share the tokenizer of the policy "
            f"{policy_name!r} ({policy_path or policy_tokenizer or '?'}, fingerprint "
            f"{policy_fp[:12]} {policy_from}): cross-sampled calls send the policy's token ids "
            "to the other model, so both need the same vocabulary; choose a --cross-model of "
            "the policy's model family"
        )
    if policy_path and policy_path == cross_path:
        return
    raise CrossSamplingError(
        f"cannot check that the cross model {cross_name!r} shares the tokenizer of the policy "
        f"{policy_name!r}: its /model_info reports no {FINGERPRINT} and its tokenizer_path "
        f"{cross_path or '(none)'!r} is not a model directory on this machine (the policy's is "
        f"{policy_path or policy_tokenizer or '(none)'!r}); serve it with `agentarium engine`, "
        "or make its tokenizer_path readable here (the same path on a shared disk)"
    )


async def _model_info(backend: Any, who: str) -> dict:
    info = getattr(backend, "model_info", None)
    if info is None:
        raise CrossSamplingError(
            f"cannot read the tokenizer of {who}: its backend has no /model_info (cross-sampling "
            "a training rollout needs SGLang servers or `agentarium engine`)"
        )
    try:
        return dict(await info())
    except LLMError as exc:
        raise CrossSamplingError(
            f"cannot check the tokenizer of {who}: {exc}; start its servers first (the check "
            "runs once, when the consumer starts)"
        ) from exc
