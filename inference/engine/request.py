"""A `/generate` request, parsed and validated the way SGLang does, with the same defaults.

The engine supports the sampling that the trainer can reproduce (temperature, top_p, top_k,
min_p, stop strings and ids, seeds), and `stream: true` (answered in SGLang's incremental
chunks: stream.py). SGLang options that would change the logits (penalties, grammars, logit
bias) or the response's shape (n > 1, batches) are refused with a 400 that says so, never
silently ignored.
"""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest

# SGLang fields that the local engine accepts only at their default value.
_UNSUPPORTED_SAMPLING = {
    "n": 1,
    "min_new_tokens": 0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "logit_bias": None,
    "custom_params": None,
    "stop_regex": None,
}
_IGNORED_SAMPLING = {"spaces_between_special_tokens", "stream_interval"}
_SAMPLING = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "stop",
    "stop_token_ids",
    "sampling_seed",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
}
_UNSUPPORTED_TOP = {
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "input_embeds": None,
    "token_ids_logprob": None,
    "lora_id": None,
    "session_params": None,
    "custom_logit_processor": None,
    "return_hidden_states": False,
}
_IGNORED_TOP = {"log_metrics", "no_logs", "extra_key", "priority", "data_parallel_rank"}
_TOP = {
    "text",
    "input_ids",
    "sampling_params",
    "return_logprob",
    "logprob_start_len",
    "top_logprobs_num",
    "return_text_in_logprobs",
    "rid",
    "stream",  # chunks as SGLang's --incremental-streaming-output writes them (stream.py)
    "lora_path",  # the adapter to answer with (inference/engine/lora.py)
}


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 (or 0): the whole vocabulary
    min_p: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    sampling_seed: int | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @property
    def greedy(self) -> bool:
        # SGLang: temperature below 1e-6 means argmax, with logprobs taken at temperature 1.
        return self.temperature < 1e-6

    @property
    def filtered(self) -> bool:
        return self.top_p < 1.0 or self.top_k > 0 or self.min_p > 0.0


@dataclass(frozen=True, kw_only=True)
class GenerateRequest:
    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False  # answered chunk by chunk: LocalEngine.generate_stream
    lora_path: str | None = None  # a LoRA adapter's name, as loaded by /load_lora_adapter


def parse_generate(
    data: Any, *, encode: Callable[[str], list[int]], vocab_size: int, context_len: int
) -> GenerateRequest:
    """Validate a `/generate` body; raise InvalidRequest with a message saying what to fix."""
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    _check_fields(data, _TOP, _UNSUPPORTED_TOP, _IGNORED_TOP, where="request")
    input_ids = _input_ids(data, encode, vocab_size)
    sampling = _sampling(data.get("sampling_params") or {})
    n = len(input_ids)
    if n >= context_len:
        raise InvalidRequest(
            f"The input ({n} tokens) is longer than the model's context length "
            f"({context_len} tokens)."
        )
    if n + sampling.max_new_tokens > context_len:
        raise InvalidRequest(
            f"Requested token count exceeds the model's maximum context length of {context_len} "
            f"tokens. You requested a total of {n + sampling.max_new_tokens} tokens: {n} tokens "
            f"from the input messages and {sampling.max_new_tokens} tokens for the completion. "
            "Please reduce the number of tokens in the input messages or the completion to fit "
            "within the limit."
        )
    logprob_start_len = _int(data.get("logprob_start_len", -1), "logprob_start_len")
    if logprob_start_len < -1 or logprob_start_len >= max(n, 1):
        raise InvalidRequest(
            f"logprob_start_len must be -1 (output tokens only) or a prompt position in "
            f"[0, {n - 1}], got {logprob_start_len}"
        )
    top_logprobs_num = _int(data.get("top_logprobs_num") or 0, "top_logprobs_num")
    if not 0 <= top_logprobs_num <= vocab_size:
        raise InvalidRequest(f"top_logprobs_num must be in [0, {vocab_size}]")
    rid = data.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise InvalidRequest("rid must be a string (batches of rids are not supported)")
    lora_path = data.get("lora_path")
    if lora_path is not None and not isinstance(lora_path, str):
        raise InvalidRequest("lora_path must be the name of a loaded LoRA adapter (a string)")
    return GenerateRequest(
        rid=rid or uuid.uuid4().hex,
        input_ids=tuple(input_ids),
        sampling=sampling,
        return_logprob=_bool(data.get("return_logprob", False), "return_logprob"),
        logprob_start_len=logprob_start_len,
        top_logprobs_num=top_logprobs_num,
        return_text_in_logprobs=_bool(
            data.get("return_text_in_logprobs", False), "return_text_in_logprobs"
        ),
        stream=_bool(False if data.get("stream") is None else data["stream"], "stream"),
        lora_path=lora_path,
    )


def _input_ids(data: dict, encode: Callable[[str], list[int]], vocab_size: int) -> list[int]:
    text, ids = data.get("text"), data.get("input_ids")
    if (text is None) == (ids is None):
        raise InvalidRequest("send exactly one of input_ids (a list of token ids) or text")
    if text is not None:
        if not isinstance(text, str):
            raise InvalidRequest(
                "text must be a string: the local engine serves one prompt per request"
            )
        ids = encode(text)
    if not isinstance(ids, list) or any(isinstance(i, list) for i in ids):
        raise InvalidRequest(
            "input_ids must be one flat list of token ids: the local engine serves one prompt "
            "per request"
        )
    if not ids:
        raise InvalidRequest("the prompt is empty: send at least one token")
    for i in ids:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size:
            raise InvalidRequest(
                f"input_ids holds {i!r}: token ids are integers in [0, {vocab_size})"
            )
    return list(ids)


def _sampling(params: Any) -> SamplingParams:
    if not isinstance(params, dict):
        raise InvalidRequest("sampling_params must be a JSON object")
    _check_fields(
        params, _SAMPLING, _UNSUPPORTED_SAMPLING, _IGNORED_SAMPLING, where="sampling_params"
    )
    defaults = SamplingParams()
    max_new = _int(params.get("max_new_tokens", defaults.max_new_tokens), "max_new_tokens")
    temperature = _float(params.get("temperature", defaults.temperature), "temperature")
    top_p = _float(params.get("top_p", defaults.top_p), "top_p")
    top_k = _int(params.get("top_k", defaults.top_k), "top_k")
    min_p = _float(params.get("min_p", defaults.min_p), "min_p")
    if max_new < 0:
        raise InvalidRequest(f"max_new_tokens must be at least 0, got {max_new}")
    if temperature < 0:
        raise InvalidRequest(f"temperature must be non-negative, got {temperature}")
    if not 0 < top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise InvalidRequest(f"top_k must be -1 (disable), or at least 1, got {top_k}")
    if not 0 <= min_p <= 1:
        raise InvalidRequest(f"min_p must be in [0, 1], got {min_p}")
    stop = params.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple) or not all(isinstance(s, str) and s for s in stop):
        raise InvalidRequest("stop must be a non-empty string or a list of non-empty strings")
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(
        isinstance(i, int) and not isinstance(i, bool) for i in stop_ids
    ):
        raise InvalidRequest("stop_token_ids must be a list of integers")
    seed = params.get("sampling_seed")
    if seed is not None:
        seed = _int(seed, "sampling_seed")
        if not -(2**63) <= seed < 2**64:  # what a torch.Generator can be seeded with
            raise InvalidRequest(f"sampling_seed must be in [-2**63, 2**64), got {seed}")
    return SamplingParams(
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        stop=tuple(stop),
        stop_token_ids=frozenset(stop_ids),
        sampling_seed=seed,
        ignore_eos=_bool(params.get("ignore_eos", False), "ignore_eos"),
        skip_special_tokens=_bool(params.get("skip_special_tokens", True), "skip_special_tokens"),
        no_stop_trim=_bool(params.get("no_stop_trim", False), "no_stop_trim"),
    )


def _check_fields(
    data: dict, known: set[str], unsupported: dict[str, Any], ignored: set[str], *, where: str
) -> None:
    for key, value in data.items():
        if key in known or key in ignored:
            continue
        if key in unsupported:
            if value is not None and value != unsupported[key]:
                raise InvalidRequest(
                    f"{where}.{key}={value!r} is not supported by the local engine; leave it "
                    f"at {unsupported[key]!r}, or use an SGLang server"
                )
            continue
        raise InvalidRequest(
            f"unknown {where} field {key!r}; known fields: {', '.join(sorted(known))}"
        )


def _int(value: Any, name: str) -> int:
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value != int(value)
    ):
        raise InvalidRequest(f"{name} must be an integer, got {value!r}")
    return int(value)


def _float(value: Any, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequest(f"{name} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}")
    return value
