"""The OpenAI Responses API (``POST /v1/responses``), with and without streaming.

``input`` (a string, or items: messages, ``function_call``, ``function_call_output``) and
``instructions`` become chat messages for one ``llm.chat``: an assistant message and the
function calls after it are one assistant turn, each output one ``tool`` message, so a
conversation sent back in full renders as the recorded one. The reply is a ``response`` object:
a ``reasoning`` item when a thinking model reasoned (its text a ``reasoning_text`` part, as
gpt-oss's; sent back in ``input``, it is the next assistant turn's ``reasoning_content``), a
``message`` item with one ``output_text`` part when the policy wrote text (or nothing else),
then one ``function_call`` item per tool call, its ``call_id`` the recorded call's id. Streamed,
it is OpenAI's event sequence (``response.created``, ``response.in_progress``, per item
``response.output_item.added``, the reasoning, text or arguments deltas and their ``done``,
``response.output_item.done``, then ``response.completed``, or ``response.incomplete`` when the
reply hit ``max_output_tokens``), each event numbered by ``sequence_number``, written as the reply
is generated (sse.py).

``previous_response_id`` continues a response of the same rollout: the rollout's ``Route``
keeps each conversation (unless ``store: false``), its instructions aside, as OpenAI does not
carry them over. Only function tools are served.
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
from .route import ChatCall, Route, list_field, text_of, thinking_of_effort
from .sse import Block, OnDelta, StreamShape, blocks_of, event, serve_stream

SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed")
IGNORED = frozenset(
    {
        "metadata",
        "user",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "service_tier",
        "parallel_tool_calls",
        "stream_options",
        "store",
        "client_metadata",  # Codex CLI's bookkeeping
    }
)
REFUSED = {
    "background": "responses are generated while the request waits",
    "conversation": "conversations are not stored; send previous_response_id or the full input",
    "prompt": "stored prompts are not served",
    "max_tool_calls": "the number of tool calls cannot be capped",
    "top_logprobs": "token logprobs are recorded in the trajectory, not returned to the agent",
}
KNOWN = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "max_output_tokens",
        "previous_response_id",
        "stream",
        "text",
        "reasoning",
        "include",
        "truncation",
        *SAMPLING_FIELDS,
        *IGNORED,
        *REFUSED,
    }
)
# include values with nothing to add: reasoning items carry their text, never encrypted content.
_INCLUDABLE = frozenset({"reasoning.encrypted_content"})
_TEXT_PARTS = ("input_text", "output_text")


@dataclass(frozen=True)
class ResponsesRequest:
    call: ChatCall
    conversation: list[dict]  # without the instructions: what a next response continues
    stream: bool
    store: bool


def parse(body: dict, route: Route) -> ResponsesRequest:
    refuse_unknown(body, KNOWN, "responses")
    refuse_set(body, REFUSED)
    _check_options(body)
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise GatewayError("previous_response_id must be a string", param="previous_response_id")
    conversation = route.responses.get(previous) if previous else []
    conversation += input_messages(body.get("input"))
    if not conversation:
        raise GatewayError("the request needs an 'input'", param="input")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise GatewayError("instructions must be a string", param="instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    sampling = {key: body[key] for key in SAMPLING_FIELDS if body.get(key) is not None}
    if body.get("max_output_tokens") is not None:
        sampling["max_tokens"] = body["max_output_tokens"]
    schema = _json_schema(body.get("text"))
    if schema is not None:
        sampling["json_schema"] = schema
    return ResponsesRequest(
        call=ChatCall(
            [*system, *conversation],
            _tools(body),
            sampling,
            thinking=thinking_of_effort((body.get("reasoning") or {}).get("effort"), "reasoning"),
        ),
        conversation=conversation,
        stream=bool(body.get("stream")),
        store=body.get("store") is not False,
    )


def _check_options(body: dict) -> None:
    # The effort turns reasoning on or off (the tracing client refuses what the model cannot
    # do); summaries of reasoning items are never produced: asking for one asks for nothing.
    reasoning = body.get("reasoning") or {}
    if not isinstance(reasoning, dict):
        raise GatewayError("reasoning must be an object", param="reasoning")
    thinking_of_effort(reasoning.get("effort"), "reasoning.effort")
    extra = [
        v for v in list_field(body, "include") if not isinstance(v, str) or v not in _INCLUDABLE
    ]
    if extra:
        raise GatewayError(
            f"include {extra!r} cannot be served (token logprobs are recorded in the "
            "trajectory; there are no tool results to add)",
            param="include",
        )
    if body.get("truncation") not in (None, "disabled"):
        raise GatewayError(
            "truncation 'auto' is not served: a prompt over the model's context is refused, "
            "never cut",
            param="truncation",
        )


def input_messages(items: Any) -> list[dict]:
    """Responses input items as chat messages (see the module docstring)."""
    if items is None:
        return []
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list):
        raise GatewayError("input must be a string or a list of items", param="input")
    messages: list[dict] = []
    for index, item in enumerate(items):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise GatewayError(f"{where} must be an object", param="input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise GatewayError(f"{where} has role {role!r}", param="input")
            content = text_of(item.get("content"), f"{where}.content", _TEXT_PARTS)
            last = messages[-1] if messages else None
            if role == "assistant" and last is not None and _reasoning_only(last):
                last["content"] = content  # the message of the turn its reasoning began
                continue
            messages.append({"role": "system" if role == "developer" else role, "content": content})
        elif kind == "reasoning":  # sent back: the reasoning of the assistant turn after it
            parts = item.get("content") or []
            if not parts and item.get("encrypted_content"):
                raise GatewayError(
                    f"{where} is encrypted reasoning (another provider's): the Agentarium "
                    "gateway reads reasoning items by their reasoning_text content",
                    param="input",
                )
            text = text_of(parts, f"{where}.content", ("reasoning_text",)) if parts else ""
            messages.append({"role": "assistant", "content": "", "reasoning_content": text})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": _string(item, "arguments", where),
                },
            }
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = text_of(item.get("output"), f"{where}.output", _TEXT_PARTS)
            call_id = _string(item, "call_id", where)
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        else:
            raise GatewayError(
                f"{where} is a {kind!r} item: the Agentarium gateway serves messages, "
                "function_call and function_call_output items",
                param="input",
            )
    return messages


def _reasoning_only(message: dict) -> bool:
    """An assistant turn that so far holds a reasoning item alone."""
    return (
        message["role"] == "assistant"
        and "reasoning_content" in message
        and not message["content"]
        and not message.get("tool_calls")
    )


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise GatewayError(f"{where} needs a '{key}' string", param="input")
    return value


def _tools(body: dict) -> list[dict] | None:
    choice = body.get("tool_choice")
    if choice not in (None, "auto", "none"):
        raise GatewayError(
            f"tool_choice {choice!r} cannot be enforced: the policy's tool calls are parsed from "
            "the text it writes; send tool_choice 'auto' (or 'none')",
            param="tool_choice",
        )
    tools = []
    for index, tool in enumerate(list_field(body, "tools")):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function" or not isinstance(tool.get("name"), str):
            raise GatewayError(
                f"tools[{index}] is a {kind!r} tool: only function tools ({{'type': 'function', "
                "'name': ..., 'parameters': {...}}) are served (the gateway runs no built-in tool)",
                param="tools",
            )
        function = {"name": tool["name"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("parameters") or {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": function})
    return None if choice == "none" else tools or None


def _json_schema(text: Any) -> str | None:
    text = text or {}
    if not isinstance(text, dict):
        raise GatewayError("text must be an object", param="text")
    if text.get("verbosity") not in (None, "medium"):
        raise GatewayError("text.verbosity cannot be configured per request", param="text")
    fmt = text.get("format") or {"type": "text"}
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return json.dumps({"type": "object"})
    if kind == "json_schema" and isinstance(fmt.get("schema"), dict):
        return json.dumps(fmt["schema"])
    raise GatewayError(
        "text.format must be {'type': 'text'}, {'type': 'json_object'} or {'type': "
        "'json_schema', 'schema': {...}}",
        param="text",
    )


async def serve(request: web.Request, body: dict, route: Route) -> web.StreamResponse:
    parsed = parse(body, route)
    shape = ResponseShape(body, str(body.get("model") or route.llm.model_name))

    async def call(on_delta: OnDelta | None = None) -> ChatResult:
        result = await parsed.call.run(route.llm, on_delta)
        if parsed.store:
            route.responses.put(shape.id, [*parsed.conversation, result.message])
        return result

    if not parsed.stream:
        return web.json_response(shape.response(await call()))
    return await serve_stream(request, call, shape)


def _hex() -> str:
    return uuid.uuid4().hex


class ResponseShape(StreamShape):
    """One response's object and events."""

    def __init__(self, body: dict, model: str) -> None:
        self.body = body
        self.model = model
        self.id = f"resp_{_hex()}"
        self.created = int(time.time())
        self._sequence = 0

    def refusal(self, error: GatewayError) -> web.StreamResponse:
        return openai_error(error)

    def response(
        self, result: ChatResult | None, items: list[dict] | None = None, **override: Any
    ) -> dict:
        """The response object: finished with ``result`` (its output ``items``, or made from
        the result), in progress without."""
        body = self.body
        response: dict[str, Any] = {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": "in_progress",
            "error": None,
            "incomplete_details": None,
            "instructions": body.get("instructions"),
            "max_output_tokens": body.get("max_output_tokens"),
            "model": self.model,
            "output": [],
            "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "previous_response_id": body.get("previous_response_id"),
            "reasoning": {"effort": None, "summary": None},
            "store": body.get("store") is not False,
            "temperature": body.get("temperature"),
            "text": body.get("text") or {"format": {"type": "text"}},
            "tool_choice": body.get("tool_choice") or "auto",
            "tools": body.get("tools") or [],
            "top_p": body.get("top_p"),
            "truncation": "disabled",
            "usage": None,
            "user": body.get("user"),
            "metadata": body.get("metadata") or {},
        }
        if result is not None:
            length = result.finish_reason == "length"
            response["status"] = "incomplete" if length else "completed"
            if length:
                response["incomplete_details"] = {"reason": "max_output_tokens"}
            response["output"] = items if items is not None else self.items(result)
            response["usage"] = _usage(result)
        response.update(override)
        return response

    def items(self, result: ChatResult) -> list[dict]:
        """The output items of a finished reply (unstreamed: a stream makes them as it goes)."""
        blocks = blocks_of(result)
        for block in blocks:
            block.id = f"{_ID_PREFIXES[block.kind]}_{_hex()}"
        return [self._item(block) for block in blocks]

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return event(data, kind)

    def head(self, result: ChatResult | None) -> Iterable[bytes]:
        yield self._event("response.created", response=self.response(None))
        yield self._event("response.in_progress", response=self.response(None))

    def open(self, block: Block) -> Iterable[bytes]:
        block.id = f"{_ID_PREFIXES[block.kind]}_{_hex()}"
        item = self._item(block)
        index = block.index
        if block.kind == "text":
            opened = {**item, "status": "in_progress", "content": []}
            yield self._event("response.output_item.added", output_index=index, item=opened)
            empty = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield self._event("response.content_part.added", **_ids(block), part=empty)
        elif block.kind == "reasoning":
            opened = {**item, "status": "in_progress", "content": []}
            yield self._event("response.output_item.added", output_index=index, item=opened)
        else:
            opened = {**item, "status": "in_progress", "arguments": ""}
            yield self._event("response.output_item.added", output_index=index, item=opened)

    def delta(self, block: Block, piece: str) -> Iterable[bytes]:
        if block.kind == "text":
            yield self._event("response.output_text.delta", **_ids(block), delta=piece, logprobs=[])
        elif block.kind == "reasoning":
            yield self._event("response.reasoning_text.delta", **_ids(block), delta=piece)
        else:
            ids = {"item_id": block.id, "output_index": block.index}
            yield self._event("response.function_call_arguments.delta", **ids, delta=piece)

    def close(self, block: Block) -> Iterable[bytes]:
        item = self._item(block)
        if block.kind == "text":
            ids = _ids(block)
            yield self._event("response.output_text.done", **ids, text=block.text, logprobs=[])
            yield self._event("response.content_part.done", **ids, part=item["content"][0])
        elif block.kind == "reasoning":
            yield self._event("response.reasoning_text.done", **_ids(block), text=block.text)
        else:
            yield self._event(
                "response.function_call_arguments.done",
                item_id=block.id,
                output_index=block.index,
                name=item["name"],
                arguments=item["arguments"],
            )
        yield self._event("response.output_item.done", output_index=block.index, item=item)

    def tail(self, result: ChatResult, blocks: list[Block]) -> Iterable[bytes]:
        final = self.response(result, [self._item(block) for block in blocks])
        done = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        yield self._event(done, response=final)

    @staticmethod
    def _item(block: Block) -> dict:
        """The output item a block makes (as ``items`` makes it from a whole result)."""
        if block.kind == "reasoning":
            return {
                "id": block.id,
                "type": "reasoning",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": block.text}],
                "encrypted_content": None,
                "status": "completed",
            }
        if block.kind == "text":
            text = {"type": "output_text", "text": block.text, "annotations": [], "logprobs": []}
            return {
                "id": block.id,
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [text],
            }
        assert block.call is not None
        return {
            "id": block.id,
            "type": "function_call",
            "status": "completed",
            "call_id": block.call["id"],
            "name": block.call["function"]["name"],
            "arguments": block.text,
        }

    def failure(self, error: GatewayError, *, started: bool) -> Iterable[bytes]:
        code = "invalid_prompt" if error.kind == "invalid_request" else "server_error"
        if not started:
            yield self._event("response.created", response=self.response(None))
        failed = self.response(
            None, status="failed", error={"code": code, "message": error.message}
        )
        yield self._event("response.failed", response=failed)


_ID_PREFIXES = {"reasoning": "rs", "text": "msg", "tool_call": "fc"}


def _ids(block: Block) -> dict:
    return {"item_id": block.id, "output_index": block.index, "content_index": 0}


def _usage(result: ChatResult) -> dict:
    prompt, output = result.prompt_tokens, result.output_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": result.cached_tokens},
        "output_tokens": output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + output,
    }
