"""VLLMBackend: vLLM's token-in/token-out ``POST /inference/v1/generate`` over one or more servers.

The fleet behaviour is SGLangBackend's (balancing with every sample of a group on one server,
retries, failover, the circuit breaker, resubmitting an empty abort): only the request and the
response differ. vLLM serves this route when started with ``--enable-scale-out`` (or
``--tokens-only``); its control routes need ``VLLM_SERVER_DEV_MODE=1`` (VLLM_API.md).

Request: ``token_ids`` and ``sampling_params`` in vLLM's names (SGLang's ``max_new_tokens`` is
``max_tokens``, ``sampling_seed`` is ``seed``, ``min_new_tokens`` is ``min_tokens``,
``no_stop_trim`` is ``include_stop_str_in_output``, a JSON schema or a regex is
``structured_outputs``), ``logprobs: 0`` (the sampled token's log-prob), ``request_id`` (the
call's rid, ``-r<n>`` on a resubmission), and, with a LoRA adapter, its name as ``model``.

Response (``output_mode`` tokens, the default: its log-prob entries name their token ids, which
text mode's do not): the one choice's ``token_ids`` (the matched stop token included, as
SGLang's), its ``logprobs.content`` aligned with them (each entry's ``token_id`` checked),
``finish_reason`` (``stop``, ``length`` or ``abort``) and ``weight_versions``, the version of
every output token as half-open spans: the call's ``weight_version`` is the last span's, and
several spans become ``GenerateResult.weight_spans``. The text is decoded here with the
consumer's tokenizer (``decode``: special tokens kept, as the tool-call and reasoning markers of
some families are special tokens) and trimmed as SGLang's and vLLM's own text are: without the
stop token that ended it (``stop_reason`` a token id, or None for the end-of-sequence token),
and cut where a matched stop string (``stop_reason`` a string) begins, unless
``no_stop_trim``.

Streaming (``generate(request, on_chunk=...)``, ``VLLMStream``): ``"stream": true`` with
``stream_options.include_usage`` (so the token counts come as in the unstreamed answer, on a
last chunk of no choice). Each chunk's choice holds that step's ``token_ids`` and log-probs;
``weight_versions`` is null on every chunk but the one with a ``finish_reason``, which lists
the whole call's spans, so a chunk handed on names no version (``GenerateChunk``'s
``"default"``). The chunks' text is decoded here as the ids arrive (``IncrementalDecode``),
held back as ``streaming.HeldText`` says; the result's text is the whole reply's
(``reply_text``). A stream left early is aborted with ``POST /inference/v1/abort_requests
{"request_ids": ["generate-tokens-<rid>"]}``: vLLM's route (``--enable-scale-out``) takes the
ids the engine was given, and its token route gives the engine ``generate-tokens-`` and the
call's ``request_id`` (the id each chunk reports).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from agentarium.formats import HeldText, IncrementalDecode

from .base import GenerateChunk, GenerateRequest, GenerateResult, OnChunk
from .sglang import SGLangBackend, weight_spans
from .streaming import ChunkReader, stop_strings

# SGLang's sampling keys (what the tracing client sends) -> vLLM's SamplingParams names
RENAMED = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "sampling_seed": "seed",
    "no_stop_trim": "include_stop_str_in_output",
}
_FINISH = ("stop", "length", "abort")
# vLLM's token route names the engine's request "generate-tokens-<request_id>" (serving.py)
ENGINE_ID_PREFIX = "generate-tokens-"


def vllm_sampling(sampling: dict[str, Any]) -> dict[str, Any]:
    """SGLang-named sampling parameters in vLLM's names (see the module docstring)."""
    out: dict[str, Any] = {"skip_special_tokens": False}
    for key, value in sampling.items():
        if key == "json_schema":
            out["structured_outputs"] = {"json": value}
        elif key == "regex":
            out["structured_outputs"] = {"regex": value}
        else:
            out[RENAMED.get(key, key)] = value
    out["logprobs"] = 0
    return out


def _one_choice(choices: Any, data: Any, what: str) -> tuple[dict, list]:
    """The one choice of a response or chunk, and its ``token_ids``; ValueError otherwise."""
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise ValueError(f"the {what} has not exactly one choice: {str(data)[:200]}")
    ids = choices[0].get("token_ids")
    if not isinstance(ids, list):
        raise ValueError(f"the {what}'s choices[0].token_ids is missing")
    return choices[0], ids


def parse_vllm_response(data: Any, *, url: str = "", latency_s: float = 0.0) -> GenerateResult:
    """An ``/inference/v1/generate`` response as a ``GenerateResult`` (its text empty: see
    ``reply_text``); raises ValueError when it cannot be trained on (no single choice,
    log-probs not aligned with the ids, bad spans)."""
    choices = data.get("choices") if isinstance(data, dict) else None
    choice, ids = _one_choice(choices, data, "response")
    logprobs = checked_entries(choice, ids)
    finish = choice.get("finish_reason")
    if finish not in _FINISH:
        raise ValueError(f"unknown finish_reason {finish!r}")
    listed = choice.get("weight_versions") or []
    if not isinstance(listed, list):
        raise ValueError(f"weight_versions is not a list: {str(listed)[:200]}")
    # a span without a version: the server reported none ("default", as before any update)
    listed = [
        {**s, "version": "default" if s.get("version") is None else s["version"]}
        if isinstance(s, dict)
        else s
        for s in listed
    ]
    version = str(listed[-1]["version"]) if listed and isinstance(listed[-1], dict) else "default"
    usage = data.get("usage") or {}
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    return GenerateResult(
        output_ids=[int(t) for t in ids],
        output_logprobs=logprobs,
        text="",
        finish_reason=finish,
        weight_version=version,
        weight_spans=weight_spans(listed, len(ids), version),
        cached_tokens=int(cached or 0),
        prompt_tokens=int(usage.get("prompt_tokens") or 0),
        completion_tokens=int(usage.get("completion_tokens") or len(ids)),
        backend=url,
        latency_s=latency_s,
        meta_info={"id": data.get("request_id", ""), "stop_reason": choice.get("stop_reason")},
    )


def checked_entries(choice: dict, ids: list, offset: int = 0) -> list[float]:
    """A choice's log-probs (``logprobs.content``), checked one by one against ``ids``
    (``offset``: the index of the first, for the message); ValueError when they differ."""
    entries = (choice.get("logprobs") or {}).get("content")
    if not isinstance(entries, list) or len(entries) != len(ids):
        got = len(entries) if isinstance(entries, list) else "no"
        raise ValueError(f"{got} log-probs for {len(ids)} token_ids: was logprobs 0 sent?")
    logprobs: list[float] = []
    for i, (entry, token) in enumerate(zip(entries, ids, strict=True), offset):
        value = entry.get("logprob") if isinstance(entry, dict) else None
        if (
            not isinstance(entry, dict)
            or entry.get("token_id") != token
            or isinstance(value, bool)
            or not isinstance(value, int | float)
            or math.isnan(value)
        ):
            raise ValueError(f"logprobs.content[{i}] = {str(entry)[:120]} does not match {token}")
        logprobs.append(float(value))
    return logprobs


class VLLMStream(ChunkReader):
    """vLLM's streamed ``/inference/v1/generate`` chunks (the module docstring) put together
    into its unstreamed answer (``response()``); ``feed`` returns each chunk but the last as
    the ``GenerateChunk`` to hand on, its text decoded here."""

    def __init__(self, decode: Callable[[Sequence[int]], str], *, stops: Sequence[str] = ()):
        self.decoded = IncrementalDecode(decode)
        self.held = HeldText(stops)
        self.ids: list[int] = []
        self.entries: list[Any] = []
        self.handed = 0  # tokens handed on
        self.rid = ""  # the chunks' request_id: the engine's name for the request
        self.usage: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None  # the choice with a finish_reason

    def feed(self, data: Any) -> GenerateChunk | None:
        data = self.chunk_object(data)
        self.rid = str(data.get("request_id") or self.rid)
        if data.get("usage"):
            self.usage = data["usage"]
        choices = data.get("choices")
        if not choices:
            return None  # the counts' chunk (include_usage)
        choice, ids = _one_choice(choices, data, "chunk")
        logprobs = checked_entries(choice, ids, len(self.ids))
        self.ids += ids
        self.entries += choice["logprobs"]["content"]
        if choice.get("finish_reason") is not None:
            self.last = choice
            return None
        if not ids:
            return None
        piece = self.held.release(self.decoded.add(ids))
        self.handed += len(ids)
        return GenerateChunk([int(t) for t in ids], logprobs, piece)

    def response(self) -> dict[str, Any]:
        """The unstreamed answer, put together (for ``parse_vllm_response``)."""
        if self.last is None:
            raise ValueError("the stream ended before its last chunk (one with a finish_reason)")
        choice = {**self.last, "token_ids": self.ids, "logprobs": {"content": self.entries}}
        return {"request_id": self.rid, "usage": self.usage or {}, "choices": [choice]}


def reply_text(
    result: GenerateResult, decode: Callable[[Sequence[int]], str], *, keep_stop: bool = False
) -> str:
    """The reply's text as SGLang and vLLM write theirs (the module docstring)."""
    ids = list(result.output_ids)
    stop = result.meta_info.get("stop_reason")
    if result.finish_reason == "stop" and ids and not isinstance(stop, str) and not keep_stop:
        ids = ids[:-1]  # the stop token (an id of stop_token_ids, or the end of sequence)
    text = decode(ids)
    if result.finish_reason == "stop" and isinstance(stop, str) and stop and not keep_stop:
        cut = text.find(stop)
        if cut != -1:
            text = text[:cut]
    return text


class VLLMBackend(SGLangBackend):
    """Token-in/token-out generation on a vLLM fleet (the module docstring)."""

    provider_name = "vllm"
    engine_name = "vLLM"
    generate_path = "/inference/v1/generate"

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        decode: Callable[[Sequence[int]], str],
        **kwargs: Any,
    ) -> None:
        """``decode``: ids to text with the consumer's tokenizer, special tokens kept
        (``ChatTemplate.decode``); the other arguments are SGLangBackend's."""
        super().__init__(urls, **kwargs)
        self.decode = decode

    async def generate(
        self, request: GenerateRequest, on_chunk: OnChunk | None = None
    ) -> GenerateResult:
        result = await super().generate(request, on_chunk)
        keep = bool(request.sampling.get("no_stop_trim"))
        return replace(result, text=reply_text(result, self.decode, keep_stop=keep))

    def _body(self, request: GenerateRequest, attempt: int) -> dict[str, Any]:
        body: dict[str, Any] = {
            "token_ids": list(request.input_ids),
            "sampling_params": vllm_sampling(dict(request.sampling)),
        }
        rid = self._rid(request, attempt)
        if rid:
            body["request_id"] = rid
        if self.lora:
            body["model"] = self.lora
        return body

    def _parse(self, data: Any, url: str, latency: float) -> GenerateResult:
        return parse_vllm_response(data, url=url, latency_s=latency)

    abort_path = "/inference/v1/abort_requests"

    def _stream_body(self, request: GenerateRequest, attempt: int) -> dict[str, Any]:
        body = self._body(request, attempt)
        return {**body, "stream": True, "stream_options": {"include_usage": True}}

    def _chunks(self, request: GenerateRequest) -> VLLMStream:
        return VLLMStream(self.decode, stops=stop_strings(request.sampling))

    def _abort_body(self, rid: str, chunks: Any) -> dict[str, Any] | None:
        engine_id = chunks.rid or (ENGINE_ID_PREFIX + rid if rid else "")
        return {"request_ids": [engine_id]} if engine_id else None

    def __repr__(self) -> str:
        return f"VLLMBackend({self.balancer!r})"
