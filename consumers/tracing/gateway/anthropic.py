"""The Anthropic Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``).

``system`` and ``messages`` (text, ``tool_use`` and ``tool_result`` blocks) become chat messages
for one ``llm.chat``: an assistant message's text and ``tool_use`` blocks are one assistant turn
with tool calls (``input`` as JSON arguments), each ``tool_result`` a ``tool`` message, text
beside them a user message, in their order. The reply is a ``message``: a text block when the
policy wrote text (or nothing else), then one ``tool_use`` block per tool call, its id the
recorded call's id, after a ``thinking`` block when a thinking model reasoned (its signature
empty: the text is the model's own; sent back, it is the turn's ``reasoning_content``); ``stop_reason`` is ``tool_use``, ``max_tokens`` or ``end_turn``. Streamed,
it is Anthropic's event sequence: ``message_start``, per block ``content_block_start``, its
``thinking_delta``, ``text_delta`` or ``input_json_delta`` deltas and ``content_block_stop``, then
``message_delta`` (stop reason and usage) and ``message_stop``, written as the reply is
generated (sse.py; ``message_start``'s usage is zero then, ``message_delta`` has it whole);
``ping`` keeps a long call's connection alive. Usage follows Anthropic's split: ``input_tokens`` excludes the prompt tokens
the engine had cached, which are ``cache_read_input_tokens``.

``count_tokens`` renders the prompt with the policy's chat template and counts its tokens.
Only custom (client) tools are served. ``thinking`` may be disabled (reasoning off: refused for
a model that always reasons), adaptive (the model's default) or enabled with ``budget_tokens``
(reasoning on, at most that many tokens of it: a reply still reasoning at the budget has its
block closed for it, ``TracingLLM.chat``'s ``thinking_budget``; refused for a model that does
not reason in ``<think>`` blocks). The budget must be a positive integer below ``max_tokens``,
as Anthropic requires; Anthropic's floor of 1,024 is not applied, since the policies trained
here often answer in fewer. A final assistant message (a prefill) is refused: the template
starts a new assistant turn.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import jinja2
from aiohttp import web

from agentarium.formats import arguments_as_objects, normalize_messages, plain_data

from ..llm import ChatResult
from .errors import GatewayError, anthropic_error, refuse_set, refuse_unknown
from .route import ChatCall, Route, list_field, stop_list, text_of
from .sse import Block, StreamShape, event, serve_stream

SAMPLING_FIELDS = ("temperature", "top_p", "top_k")
IGNORED = frozenset(
    {
        "metadata",
        "cache_control",
        "service_tier",
        "inference_geo",
        "speed",
        "user_profile_id",
        "workspace_id",
        "diagnostics",
    }
)
REFUSED = {
    "container": "the gateway runs no code-execution container",
    "mcp_servers": "the gateway connects to no MCP server; give the tools to the agent",
    "context_management": "the gateway does not edit the context; the agent sends it whole",
}
KNOWN = frozenset(
    {
        "model",
        "messages",
        "system",
        "max_tokens",
        "stop_sequences",
        "stream",
        "tools",
        "tool_choice",
        "thinking",
        "output_config",
        *SAMPLING_FIELDS,
        *IGNORED,
        *REFUSED,
    }
)
STOP_REASONS = {"tool_calls": "tool_use", "length": "max_tokens"}  # otherwise end_turn
PING = event({"type": "ping"}, "ping")
_TEXT = ("text",)


@dataclass(frozen=True)
class MessagesRequest:
    call: ChatCall
    stream: bool


def parse(body: dict, *, counting: bool = False) -> MessagesRequest:
    """The request as one ``llm.chat``; ``counting`` for count_tokens (no max_tokens)."""
    refuse_unknown(body, KNOWN, "messages")
    refuse_set(body, REFUSED)
    _check_options(body)
    if not isinstance(body.get("messages"), list) or not body["messages"]:
        raise GatewayError("the request needs a non-empty 'messages' list")
    sampling = {key: body[key] for key in SAMPLING_FIELDS if body.get(key) is not None}
    if not counting:
        if body.get("max_tokens") is None:
            raise GatewayError("max_tokens: field required")
        sampling["max_tokens"] = body["max_tokens"]
        stops = stop_list(body.get("stop_sequences"), "stop_sequences")
        if stops:
            sampling["stop"] = stops
    schema = ((body.get("output_config") or {}).get("format") or {}).get("schema")
    if schema is not None:
        sampling["json_schema"] = json.dumps(schema)
    messages = chat_messages(body.get("system"), body["messages"])
    # disabled: reasoning off; enabled: on, within its budget; adaptive or unset: the default
    kind = str((body.get("thinking") or {}).get("type"))
    thinking = {"disabled": False, "enabled": True}.get(kind)
    budget = body["thinking"]["budget_tokens"] if kind == "enabled" else None
    call = ChatCall(messages, _tools(body), sampling, thinking=thinking, thinking_budget=budget)
    return MessagesRequest(call, bool(body.get("stream")))


def _check_options(body: dict) -> None:
    thinking = body.get("thinking")
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind not in ("disabled", "adaptive", "enabled"):
            raise GatewayError(
                "thinking.type must be 'enabled' (with budget_tokens), 'adaptive' or 'disabled'"
            )
        if kind == "enabled":
            budget, limit = thinking.get("budget_tokens"), body.get("max_tokens")
            if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
                raise GatewayError(
                    f"thinking.budget_tokens: a positive integer is required, got {budget!r}"
                )
            if isinstance(limit, int) and budget >= limit:
                raise GatewayError(
                    f"max_tokens must be greater than thinking.budget_tokens ({budget} >= "
                    f"{limit}): the budget is part of max_tokens"
                )
    config = body.get("output_config") or {}
    if not isinstance(config, dict) or config.get("effort") is not None:
        raise GatewayError(
            "output_config.effort cannot be served: the policy's effort is not configurable"
        )
    fmt = config.get("format")
    if fmt is not None and (
        not isinstance(fmt, dict)
        or fmt.get("type") != "json_schema"
        or not isinstance(fmt.get("schema"), dict)
    ):
        raise GatewayError("output_config.format must be {'type': 'json_schema', 'schema': {...}}")


def chat_messages(system: Any, messages: list) -> list[dict]:
    """Anthropic's system and messages as chat messages (see the module docstring)."""
    out: list[dict] = []
    if system:
        out.append({"role": "system", "content": text_of(system, "system", _TEXT)})
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, dict) else None
        content = message.get("content") if isinstance(message, dict) else None
        if role not in ("user", "assistant", "system"):
            raise GatewayError(
                f"{where}.role must be 'user', 'assistant' or 'system', got {role!r}"
            )
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(blocks, list):
            raise GatewayError(f"{where}.content must be a string or a list of content blocks")
        if role == "system":
            # Claude Code's mid-conversation system messages (its
            # mid-conversation-system beta, sent even with experimental betas off): a system
            # chat message in place, rendered by the policy's template where it stands.
            out.append({"role": "system", "content": text_of(blocks, where, _TEXT)})
            continue
        out.extend(_assistant(blocks, where) if role == "assistant" else _user(blocks, where))
    if out[-1]["role"] == "assistant":
        raise GatewayError(
            "a final assistant message (a prefill) is not supported: the policy's chat template "
            "starts a new assistant turn"
        )
    return out


def _block_type(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise GatewayError(f"{where} must be a content block object with a 'type'")
    return block["type"]


def _user(blocks: list, where: str) -> list[dict]:
    out: list[dict] = []
    texts: list[dict] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _block_type(block, at)
        if kind == "tool_result":
            if texts:
                out.append({"role": "user", "content": text_of(texts, at, _TEXT)})
                texts = []
            tool_id = block.get("tool_use_id")
            if not isinstance(tool_id, str):
                raise GatewayError(f"{at} needs a 'tool_use_id' string")
            content = text_of(block.get("content"), f"{at}.content", _TEXT)
            out.append({"role": "tool", "tool_call_id": tool_id, "content": content})
        elif kind == "text":
            texts.append(block)
        else:
            raise GatewayError(
                f"{at} is a {kind!r} block: the Agentarium gateway serves a text model, so user "
                "messages hold 'text' and 'tool_result' blocks"
            )
    if texts:
        out.append({"role": "user", "content": text_of(texts, where, _TEXT)})
    return out


def _assistant(blocks: list, where: str) -> list[dict]:
    texts: list[dict] = []
    calls: list[dict] = []
    thoughts: list[str] = []
    for index, block in enumerate(blocks):
        at = f"{where}.content[{index}]"
        kind = _block_type(block, at)
        if kind == "text":
            texts.append(block)
        elif kind == "thinking":  # a thinking block sent back: the turn's reasoning
            if not isinstance(block.get("thinking"), str):
                raise GatewayError(f"{at} needs a 'thinking' string")
            thoughts.append(block["thinking"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise GatewayError(f"{at} needs 'id' and 'name' strings")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)
            function = {"name": block["name"], "arguments": arguments}
            calls.append({"id": block["id"], "type": "function", "function": function})
        else:
            raise GatewayError(
                f"{at} is a {kind!r} block: assistant messages hold 'thinking', 'text' and "
                "'tool_use' blocks (the gateway produces no others)"
            )
    message: dict[str, Any] = {"role": "assistant", "content": text_of(texts, where, _TEXT)}
    if thoughts:
        message["reasoning_content"] = "\n\n".join(thoughts)
    if calls:
        message["tool_calls"] = calls
    return [message]


def _tools(body: dict) -> list[dict] | None:
    choice = body.get("tool_choice") or {"type": "auto"}
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind not in ("auto", "none"):
        raise GatewayError(
            f"tool_choice {choice!r} cannot be enforced: the policy's tool calls are parsed from "
            "the text it writes; send {'type': 'auto'} (or 'none')"
        )
    tools = []
    for index, tool in enumerate(list_field(body, "tools")):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise GatewayError(
                f"tools[{index}] is a {kind!r} tool: only custom tools (name, description, "
                "input_schema) are served; the gateway runs no server tool"
            )
        if not isinstance(tool.get("name"), str):
            raise GatewayError(f"tools[{index}] needs a 'name' string")
        function = {"name": tool["name"]}
        if tool.get("description"):
            function["description"] = tool["description"]
        function["parameters"] = tool.get("input_schema") or {"type": "object", "properties": {}}
        tools.append({"type": "function", "function": function})
    return None if kind == "none" else tools or None


async def serve(request: web.Request, body: dict, route: Route) -> web.StreamResponse:
    parsed = parse(body)
    shape = MessageShape(str(body.get("model") or route.llm.model_name))
    if not parsed.stream:
        return web.json_response(shape.message(await parsed.call.run(route.llm)))
    return await serve_stream(request, lambda on_delta: parsed.call.run(route.llm, on_delta), shape)


async def count_tokens(request: web.Request, body: dict, route: Route) -> web.StreamResponse:
    call = parse(body, counting=True).call
    template = route.llm.template
    if template is None:
        raise GatewayError(
            "count_tokens needs the policy's tokenizer: this consumer's backend is chat-native"
        )
    tools = plain_data(call.tools) if call.tools else None
    try:
        ids = template.encode_normalized(
            arguments_as_objects(normalize_messages(call.messages)), tools
        )
    except (jinja2.TemplateError, TypeError, ValueError) as exc:
        raise GatewayError(f"the chat template refused these messages: {exc}") from exc
    return web.json_response({"input_tokens": len(ids)})


class MessageShape(StreamShape):
    """One reply's message object and events."""

    keepalive = PING

    def __init__(self, model: str) -> None:
        self.model = model
        self.id = f"msg_{uuid.uuid4().hex}"

    def refusal(self, error: GatewayError) -> web.StreamResponse:
        return anthropic_error(error)

    @staticmethod
    def blocks(result: ChatResult) -> list[tuple[dict, str]]:
        """The reply's content blocks, each with the text its deltas carry (a tool call's
        arguments as the policy's JSON)."""
        blocks: list[tuple[dict, str]] = []
        if result.reasoning is not None:  # a thinking model's reasoning, first, as Claude's
            # No signature: the text is the model's own, nothing to verify when it comes back.
            thinking = {"type": "thinking", "thinking": result.reasoning, "signature": ""}
            blocks.append((thinking, result.reasoning))
        if result.content or not result.tool_calls:
            blocks.append(({"type": "text", "text": result.content}, result.content))
        for call in result.tool_calls:
            function = call["function"]
            arguments = function["arguments"] or "{}"
            block = {
                "type": "tool_use",
                "id": call["id"],
                "name": function["name"],
                "input": json.loads(arguments),
            }
            blocks.append((block, arguments))
        return blocks

    def message(self, result: ChatResult, blocks: list[tuple[dict, str]] | None = None) -> dict:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [block for block, _ in blocks or self.blocks(result)],
            "stop_reason": STOP_REASONS.get(result.finish_reason, "end_turn"),
            "stop_sequence": None,
            "usage": _usage(result),
        }

    def head(self, result: ChatResult | None) -> Iterable[bytes]:
        # live, the usage is not known yet: message_delta carries it whole
        usage = _usage(result)
        start: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": [],
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {**usage, "output_tokens": 0},
        }
        yield event({"type": "message_start", "message": start}, "message_start")

    def open(self, block: Block) -> Iterable[bytes]:
        opened: dict[str, Any]
        if block.kind == "text":
            opened = {"type": "text", "text": ""}
        elif block.kind == "reasoning":
            opened = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            assert block.call is not None
            opened = {
                "type": "tool_use",
                "id": block.call["id"],
                "name": block.call["function"]["name"],
                "input": {},
            }
        started = {"type": "content_block_start", "index": block.index, "content_block": opened}
        yield event(started, "content_block_start")

    def delta(self, block: Block, piece: str) -> Iterable[bytes]:
        kind, key = _DELTA_KEYS[block.kind]
        piece_delta = {"type": kind, key: piece}
        data = {"type": "content_block_delta", "index": block.index, "delta": piece_delta}
        yield event(data, "content_block_delta")

    def close(self, block: Block) -> Iterable[bytes]:
        yield event({"type": "content_block_stop", "index": block.index}, "content_block_stop")

    def tail(self, result: ChatResult, blocks: list[Block]) -> Iterable[bytes]:
        stop = {
            "stop_reason": STOP_REASONS.get(result.finish_reason, "end_turn"),
            "stop_sequence": None,
        }
        data = {"type": "message_delta", "delta": stop, "usage": _usage(result)}
        yield event(data, "message_delta")
        yield event({"type": "message_stop"}, "message_stop")

    def failure(self, error: GatewayError, *, started: bool) -> Iterable[bytes]:
        yield event(error.anthropic_body(), "error")


_DELTA_KEYS = {
    "text": ("text_delta", "text"),
    "reasoning": ("thinking_delta", "thinking"),
    "tool_call": ("input_json_delta", "partial_json"),
}


def _usage(result: ChatResult | None) -> dict:
    """Anthropic's usage of ``result`` (None: a reply still streaming, all zeros so far)."""
    cached = result.cached_tokens if result is not None else 0
    return {
        "input_tokens": result.prompt_tokens - cached if result is not None else 0,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached,
        "output_tokens": result.output_tokens if result is not None else 0,
    }
