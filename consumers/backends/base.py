"""The inference backend interface: one ``generate`` call, token ids in, token ids out."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from agentarium.broker import Backoff

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    """One generation. ``sampling`` is in SGLang's ``sampling_params`` shape (``max_new_tokens``,
    ``temperature``, ``top_p``, ``top_k``, ``stop``, ``stop_token_ids``, ...).

    ``route_key`` (the job's group_id) pins every sample of a GRPO group to one server so the
    shared prompt prefix is computed once. ``messages``/``tools`` are only read by chat-native
    backends (``OpenAICompatBackend``), which cannot take token ids.
    """

    input_ids: list[int]
    sampling: dict[str, Any] = field(default_factory=dict)
    rid: str = ""
    route_key: str = ""
    messages: list[dict] | None = None
    tools: list[dict] | None = None


@dataclass(frozen=True, kw_only=True)
class GenerateResult:
    """What the backend produced; ``output_logprobs`` aligns one-to-one with ``output_ids``.

    ``output_ids`` keep the matched stop token (train on them, so the policy learns to stop);
    ``text`` is the decoded output with the stop trimmed. ``tool_calls`` is only set by
    chat-native backends, which parse tool calls themselves.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    finish_reason: FinishReason
    weight_version: str = "default"  # the weights of the last output token
    # [(version, first output index), ...] when the weights changed during the generation
    # (LLMCall.weight_spans); empty: every token came from weight_version
    weight_spans: list[tuple[str, int]] = field(default_factory=list)
    cached_tokens: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    backend: str = ""
    latency_s: float = 0.0
    tool_calls: list[dict] | None = None
    # Who generated it, when a backend composes several models (cross-sampling): the model's
    # name ("" = the consumer's own) and whether it is the policy being trained.
    model: str = ""
    policy: bool = True
    meta_info: dict = field(default_factory=dict, repr=False)


@dataclass(frozen=True, slots=True)
class GenerateChunk:
    """Tokens a streaming backend received while the generation ran (every chunk but the
    last: the call's result carries all of them, and the final text, stop trimmed).

    ``text`` is the text these tokens add ("" while a character's bytes are not all there, and
    never a proper prefix of a stop string that could still match: the chunks' texts add up
    to a prefix of the result's text). ``weight_version``: the weights of the chunk's last
    token, as the server reported it.
    """

    output_ids: list[int]
    output_logprobs: list[float]
    text: str
    weight_version: str = "default"


OnChunk = Callable[[GenerateChunk], None]


@runtime_checkable
class Backend(Protocol):
    """Anything that can serve a ``GenerateRequest``; the tracing client needs nothing else.

    A backend that can stream says so with ``streams = True`` and then takes ``on_chunk``:
    ``generate(request, on_chunk=...)`` streams the request from the server and calls
    ``on_chunk`` with each chunk as it arrives, still returning the whole result (the same
    record as unstreamed). Once a chunk has been handed on, a failure is not retried (the
    caller has acted on those tokens): it raises. Cancelling ``generate`` aborts the
    server's request (``/abort_request`` by rid on SGLang and the local engine, vLLM's
    ``/inference/v1/abort_requests``).
    """

    async def generate(self, request: GenerateRequest) -> GenerateResult: ...


def streams(backend: Any) -> bool:
    """Whether ``backend.generate`` takes ``on_chunk`` (see ``Backend``)."""
    return bool(getattr(backend, "streams", False))


@dataclass(frozen=True, kw_only=True)
class BackendRetry:
    """How one LLM request is retried against one server before failing over: ``retries``
    more tries after the first, try ``n + 1`` waiting ``backoff.delay(n)`` (capped exponential,
    drawn from ``[ceiling / 2, ceiling]`` so that clients which failed together do not come
    back together)."""

    retries: int = 3
    backoff: Backoff = field(default_factory=lambda: Backoff(initial_s=0.5, max_s=8.0, jitter=0.5))

    @classmethod
    def of(
        cls, *, retries: int = 3, backoff: float = 0.5, max_backoff: float = 8.0
    ) -> BackendRetry:
        """From a backend's keywords: the first wait ``backoff``, doubling up to ``max_backoff``."""
        if retries < 0 or backoff < 0 or max_backoff < 0:
            raise ValueError("retries, backoff and max_backoff must be >= 0")
        # a first wait above the cap is the cap, as min(max_backoff, backoff * 2**n) had it
        wait = Backoff(initial_s=min(backoff, max_backoff), max_s=max_backoff, jitter=0.5)
        return cls(retries=retries, backoff=wait)


def retryable_status(status: int) -> bool:
    """5xx, 408 (timeout) and 429 (overloaded) are worth retrying; other 4xx are our fault."""
    return status >= 500 or status in (408, 429)
