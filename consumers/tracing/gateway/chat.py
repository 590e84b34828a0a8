"""OpenAI Chat Completions (``POST /v1/chat/completions``), with and without streaming.

The request becomes one ``llm.chat``; the reply is OpenAI's ``chat.completion`` object or, with
``stream: true``, its ``chat.completion.chunk`` events: the role first, a thinking model's
reasoning in ``reasoning_content`` deltas (in the message too: vLLM's and SGLang's field), the
content in deltas,
each tool call as its index, id, type and name then its arguments in deltas, the finish reason,
with ``stream_options.include_usage`` a last chunk with no choices and the usage, then
``data: [DONE]``, written as the reply is generated (sse.py). The deltas add up to the
recorded message exactly.

Fields are served, ignored (they do not change the tokens generated: ``user``, ``store``,
``parallel_tool_calls``...) or refused with the reason; a field the gateway does not know is
refused too. Text content parts are joined into one string; any other part is refused.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from ..llm import ChatResult
from .errors import GatewayError, openai_error, refuse_set, refuse_unknown
from .route import ChatCall, Route, stop_list, text_of, thinking_of_effort
from .sse import Block, StreamShape, event, serve_stream

FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}
# Request fields passed to llm.chat as sampling options under the same name (OpenAI's, plus the
# SGLang extensions agents send through extra_body).
SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "logit_bias",
)
# Fields that do not change what is generated (bookkeeping, caching hints, the service tier).
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
        "safety_identifier",
        "parallel_tool_calls",
    }
)
REFUSED = {
    "logprobs": "token logprobs are recorded in the trajectory, not returned to the agent",
    "top_logprobs": "token logprobs are recorded in the trajectory, not returned to the agent",
    "audio": "the policy is a text model",
    "prediction": "predicted outputs cannot be served",
    "web_search_options": "the gateway has no web search",
    "functions": "send tools instead (the legacy functions field is not served)",
    "function_call": "send tool_choice instead (the legacy function_call is not served)",
    "verbosity": "the policy's verbosity cannot be configured per request",
    "moderation": "the gateway runs no moderation",
}
KNOWN = frozenset(
    {
        "messages",
        "model",
        "stream",
        "stream_options",
        "n",
        "tools",
        "tool_choice",
        "response_format",
        "stop",
        "modalities",
        "reasoning_effort",
        *SAMPLING_FIELDS,
        *IGNORED,
        *REFUSED,
    }
)
_TEXT_PARTS = ("text",)


@dataclass(frozen=True)
class ChatRequest:
    call: ChatCall
    stream: bool
    include_usage: bool


def parse(body: dict) -> ChatRequest:
    """The request as one ``llm.chat``, or a GatewayError naming what cannot be served."""
    refuse_unknown(body, KNOWN, "chat completions")
    refuse_set(body, REFUSED)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise GatewayError("the request needs a non-empty 'messages' list", param="messages")
    if body.get("n") not in (None, 1):
        raise GatewayError(
            "n > 1 is not supported: one rollout samples one reply per call", param="n"
        )
    thinking = thinking_of_effort(body.get("reasoning_effort"), "reasoning_effort")
    if body.get("modalities") not in (None, ["text"]):
        raise GatewayError("only the 'text' modality is served: the policy is a text model")
    sampling = {key: body[key] for key in SAMPLING_FIELDS if body.get(key) is not None}
    stops = stop_list(body.get("stop"), "stop")
    if stops:
        sampling["stop"] = stops
    schema = _json_schema(body.get("response_format"))
    if schema is not None:
        sampling["json_schema"] = schema
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise GatewayError("stream_options must be an object", param="stream_options")
    return ChatRequest(
        call=ChatCall(
            [_message(m, i) for i, m in enumerate(body["messages"])],
            _tools(body),
            sampling,
            thinking=thinking,
        ),
        stream=bool(body.get("stream")),
        include_usage=bool(options.get("include_usage")),
    )


def _message(message: Any, index: int) -> dict:
    if not isinstance(message, dict):
        raise GatewayError(f"messages[{index}] must be an object", param="messages")
    out = dict(message)
    if out.get("role") == "developer":  # OpenAI's newer name for the system role
        out["role"] = "system"
    if isinstance(out.get("content"), list):
        out["content"] = text_of(out["content"], f"messages[{index}].content", _TEXT_PARTS)
    return out


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools") or None
    choice = body.get("tool_choice")
    if choice == "none":
        return None
    if choice not in (None, "auto"):
        raise GatewayError(
            f"tool_choice {choice!r} cannot be enforced: the policy's tool calls are parsed from "
            "the text it writes; send tool_choice 'auto' (or 'none')",
            param="tool_choice",
        )
    return tools


def _json_schema(response_format: Any) -> str | None:
    """``response_format`` as SGLang's ``json_schema`` sampling option (constrained decoding:
    an SGLang server serves it, the local engine refuses it with its reason)."""
    if response_format is None:
        return None
    kind = response_format.get("type") if isinstance(response_format, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        if isinstance(schema, dict):
            return json.dumps(schema)
    raise GatewayError(
        "response_format must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
        "'json_schema', 'json_schema': {'schema': {...}}}",
        param="response_format",
    )


async def serve(request: web.Request, body: dict, route: Route) -> web.StreamResponse:
    parsed = parse(body)
    model = str(body.get("model") or route.llm.model_name)
    if not parsed.stream:
        return web.json_response(completion(await parsed.call.run(route.llm), model))
    shape = ChatStream(model, parsed.include_usage)
    return await serve_stream(request, lambda on_delta: parsed.call.run(route.llm, on_delta), shape)


def usage(result: ChatResult) -> dict:
    prompt, completion_tokens = result.prompt_tokens, result.output_tokens
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": result.cached_tokens},
    }


def _content(result: ChatResult) -> str | None:
    # OpenAI's shape for a reply that is only tool calls: content null.
    return None if result.tool_calls and not result.content else result.content


def completion(result: ChatResult, model: str) -> dict:
    message: dict[str, Any] = {"role": "assistant", "content": _content(result), "refusal": None}
    if result.reasoning is not None:  # a thinking model's reasoning, as vLLM and SGLang return it
        message["reasoning_content"] = result.reasoning
    if result.tool_calls:
        message["tool_calls"] = result.tool_calls
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "finish_reason": FINISH.get(result.finish_reason, "stop"),
                "logprobs": None,
            }
        ],
        "usage": usage(result),
    }


class ChatStream(StreamShape):
    def __init__(self, model: str, include_usage: bool) -> None:
        self.model = model
        self.include_usage = include_usage
        self.id = f"chatcmpl-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def refusal(self, error: GatewayError) -> web.StreamResponse:
        return openai_error(error)

    def _chunk(self, delta: dict, finish: str | None = None) -> bytes:
        chunk: dict[str, Any] = {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
        }
        if self.include_usage:
            chunk["usage"] = None
        return event(chunk)

    def head(self, result: ChatResult | None) -> Iterable[bytes]:
        # content null only for a reply known to be tool calls alone (OpenAI's shape)
        content = "" if result is None or _content(result) is not None else None
        yield self._chunk({"role": "assistant", "content": content})

    def open(self, block: Block) -> Iterable[bytes]:
        if block.kind == "tool_call":
            assert block.call is not None
            head = {"name": block.call["function"]["name"], "arguments": ""}
            call = {"index": block.ordinal, "id": block.call["id"], "type": "function"}
            yield self._chunk({"tool_calls": [{**call, "function": head}]})

    def delta(self, block: Block, piece: str) -> Iterable[bytes]:
        if block.kind == "reasoning":
            yield self._chunk({"reasoning_content": piece})
        elif block.kind == "text":
            yield self._chunk({"content": piece})
        else:
            call = {"index": block.ordinal, "function": {"arguments": piece}}
            yield self._chunk({"tool_calls": [call]})

    def close(self, block: Block) -> Iterable[bytes]:
        return ()

    def tail(self, result: ChatResult, blocks: list[Block]) -> Iterable[bytes]:
        yield self._chunk({}, FINISH.get(result.finish_reason, "stop"))
        if self.include_usage:
            tail = {
                "id": self.id,
                "object": "chat.completion.chunk",
                "created": self.created,
                "model": self.model,
                "choices": [],
                "usage": usage(result),
            }
            yield event(tail)
        yield b"data: [DONE]\n\n"

    def failure(self, error: GatewayError, *, started: bool) -> Iterable[bytes]:
        # The OpenAI SDK raises an APIError for a chunk holding "error".
        yield event({"error": error.openai_body()})
        yield b"data: [DONE]\n\n"
