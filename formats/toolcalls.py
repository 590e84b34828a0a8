"""Tool calls parsed from generated text: Hermes/Qwen ``<tool_call>{json}</tool_call>`` blocks.

The policy writes its tool calls as text; agents expect OpenAI-style ``tool_calls``. A block
whose JSON does not parse is a fact about the policy (worth a reward penalty, never a crash):
it is reported in ``errors`` and its raw text stays in ``content``, so the agent and the
trajectory see exactly what the model wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

# A closed block, or an unclosed one running to the end of the text: generation may stop on
# "</tool_call>" as a stop string (SGLang trims it from the text) or on EOS right after the JSON.
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


@dataclass(frozen=True)
class ToolCallError:
    """One ``<tool_call>`` block that could not be turned into a call."""

    raw: str
    message: str


@dataclass(frozen=True)
class ParsedToolCalls:
    """The text split into plain content and OpenAI-style tool calls."""

    content: str
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _to_call(payload: Any) -> dict:
    if not isinstance(payload, dict):
        raise ValueError(
            f"expected a JSON object with name and arguments, got {type(payload).__name__}"
        )
    name = payload.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError("the tool call has no 'name' string")
    # Some fine-tunes write "parameters" for "arguments".
    arguments = payload.get("arguments", payload.get("parameters"))
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError as exc:
            raise ValueError(f"'arguments' is a string that is not JSON: {exc}") from None
    else:
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_tool_calls(text: str) -> ParsedToolCalls:
    """Split ``text`` into content and tool calls; malformed blocks become ``errors``."""
    if TOOL_CALL_OPEN not in text:
        return ParsedToolCalls(content=text)
    calls: list[dict] = []
    errors: list[ToolCallError] = []
    kept: list[str] = []  # the text outside parsed blocks, malformed blocks included
    position = 0
    for match in _BLOCK.finditer(text):
        raw = match.group(0)
        body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        try:
            payload = json.loads(body)
            # A list of calls inside one block is rare but unambiguous.
            found = (
                [_to_call(p) for p in payload] if isinstance(payload, list) else [_to_call(payload)]
            )
        except ValueError as exc:
            errors.append(ToolCallError(raw=raw, message=str(exc)))
            continue
        kept.append(text[position : match.start()])
        position = match.end()
        calls.extend(found)
    kept.append(text[position:])
    return ParsedToolCalls(content="".join(kept).strip(), tool_calls=calls, errors=errors)


def arguments_as_objects(messages: list[dict]) -> list[dict]:
    """Messages whose assistant tool-call ``arguments`` JSON strings are decoded to objects.

    OpenAI clients send arguments as a JSON string, while chat templates (Qwen2.5's among
    them) write ``arguments | tojson``, which would encode the string a second time; SGLang and
    vLLM decode them before rendering, and so do we, so the prompt shows the model the call as
    it generated it. Arguments that are not valid JSON are left as they are.
    """
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if message.get("role") == "assistant" and isinstance(calls, list):
            message = {**message, "tool_calls": [_decode_arguments(c) for c in calls]}
        out.append(message)
    return out


def _decode_arguments(call: Any) -> Any:
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    arguments = call["function"].get("arguments")
    if not isinstance(arguments, str):
        return call
    try:
        decoded = json.loads(arguments)
    except ValueError:
        return call
    return {**call, "function": {**call["function"], "arguments": decoded}}
