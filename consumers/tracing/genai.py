"""Chat spans in the OpenTelemetry GenAI semantic conventions: attribute names, the opt-in
switch for message content, and chat messages in the conventions' JSON structure.

Followed: the GenAI spans and the input/output messages JSON schemas of semantic-conventions
v1.41 (``docs/gen-ai/``), which viewers such as Arize Phoenix validate before they show a
conversation: one malformed message hides the whole list, so every part written here has the
fields its schema requires. Prompts and replies are sensitive and large, so, as the
conventions ask, they are recorded only when the user opts in with
``OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT=true``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from opentelemetry.util.types import AttributeValue

CAPTURE_CONTENT_ENV = "OTEL_INSTRUMENTATION_GENAI_CAPTURE_MESSAGE_CONTENT"
# "true" is the switch's documented value; the opentelemetry-util-genai instrumentations also
# take the span modes, which for a span-only tracer mean the same thing.
_CAPTURE_ON = frozenset({"true", "1", "span_only", "span_and_event"})

# OpenInference's input and output of a span, which Phoenix shows beside each span.
OPENINFERENCE_INPUT = "input.value"
OPENINFERENCE_INPUT_MIME = "input.mime_type"
OPENINFERENCE_OUTPUT = "output.value"
OPENINFERENCE_OUTPUT_MIME = "output.mime_type"

# Our finish reasons → the output-messages schema's (it names a tool call in the singular).
_FINISH = {"tool_calls": "tool_call"}
# SGLang sampling_params key → the conventions' request attribute.
_REQUEST = {
    "temperature": ("gen_ai.request.temperature", float),
    "top_p": ("gen_ai.request.top_p", float),
    "max_new_tokens": ("gen_ai.request.max_tokens", int),
    "sampling_seed": ("gen_ai.request.seed", int),
    "frequency_penalty": ("gen_ai.request.frequency_penalty", float),
    "presence_penalty": ("gen_ai.request.presence_penalty", float),
}


def capture_message_content(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user opted in to prompts and replies on spans (off by default)."""
    value = (os.environ if environ is None else environ).get(CAPTURE_CONTENT_ENV, "")
    return value.strip().lower() in _CAPTURE_ON


def request_attributes(params: Mapping[str, Any]) -> dict[str, AttributeValue]:
    """The request's sampling parameters under the conventions' names, those that are set.
    ``top_k`` only when it limits sampling (SGLang's -1, and 0, mean off)."""
    out: dict[str, AttributeValue] = {}
    for key, (name, cast) in _REQUEST.items():
        if params.get(key) is not None:
            out[name] = cast(params[key])
    top_k = params.get("top_k")
    if top_k is not None and top_k > 0:
        out["gen_ai.request.top_k"] = float(top_k)  # a double in the conventions
    stop = params.get("stop")
    if stop:
        out["gen_ai.request.stop_sequences"] = [str(s) for s in stop]
    return out


def error_type(exc: BaseException) -> str:
    """``error.type``: the exception's class name, low-cardinality as the conventions ask
    (``BackendUnavailable``, ``BadRequest``, ``CancelledError`` for a call cut by a deadline)."""
    return type(exc).__qualname__


def input_messages(messages: Sequence[Mapping[str, Any]]) -> str:
    """``gen_ai.input.messages``: the chat in the conventions' structure, as a JSON string
    (spans carry no nested values; the conventions allow a string there)."""
    return _json([_message(m) for m in messages])


def output_messages(message: Mapping[str, Any], finish_reason: str) -> str:
    """``gen_ai.output.messages``: the one reply, with its finish reason."""
    reply = {**_message(message), "finish_reason": _FINISH.get(finish_reason, finish_reason)}
    return _json([reply])


def tool_definitions(tools: Sequence[Any]) -> str:
    """``gen_ai.tool.definitions`` from OpenAI-style tools (``{"type": "function",
    "function": {...}}``), flattened as the conventions define them."""
    out = []
    for tool in tools:
        if not isinstance(tool, Mapping):
            continue
        function = tool.get("function")
        if isinstance(function, Mapping) and function.get("name"):
            definition = {"type": "function", "name": str(function["name"])}
            for key in ("description", "parameters"):
                if function.get(key) is not None:
                    definition[key] = function[key]
            out.append(definition)
        elif tool.get("type"):
            out.append(dict(tool))
    return _json(out)


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    role = str(message.get("role") or "user")
    parts: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content") or message.get("thinking")
    if isinstance(reasoning, str) and reasoning:
        parts.append({"type": "reasoning", "content": reasoning})
    content = message.get("content")
    if role == "tool":
        # A tool's result answers one call: the schema's tool_call_response part.
        parts.append(
            {"type": "tool_call_response", "id": message.get("tool_call_id"), "response": content}
        )
    else:
        parts.extend(_content_parts(content))
    for call in message.get("tool_calls") or []:
        parts.append(_tool_call(call))
    out: dict[str, Any] = {"role": role, "parts": parts}
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _content_parts(content: Any) -> list[dict[str, Any]]:
    if content is None or content == "":
        return []
    if isinstance(content, str):
        return [{"type": "text", "content": content}]
    if not isinstance(content, list):
        return [{"type": "text", "content": str(content)}]
    parts: list[dict[str, Any]] = []
    for item in content:  # OpenAI content parts
        if isinstance(item, str):
            parts.append({"type": "text", "content": item})
        elif isinstance(item, Mapping) and item.get("type") == "text":
            parts.append({"type": "text", "content": str(item.get("text", ""))})
        elif isinstance(item, Mapping) and item.get("type") == "image_url":
            image = item.get("image_url")
            url = image.get("url") if isinstance(image, Mapping) else image
            parts.append({"type": "uri", "modality": "image", "uri": str(url)})
        elif isinstance(item, Mapping) and isinstance(item.get("type"), str):
            parts.append(dict(item))  # the schema's generic part: any type, kept as sent
    return parts


def _tool_call(call: Any) -> dict[str, Any]:
    call = call if isinstance(call, Mapping) else {}
    function = call.get("function") if isinstance(call.get("function"), Mapping) else {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: shown as the model wrote it
    return {
        "type": "tool_call",
        "id": call.get("id"),
        "name": str(function.get("name") or ""),
        "arguments": arguments,
    }


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)
