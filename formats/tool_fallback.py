"""Tools for a chat template that renders none (SmolLM2's): an opt-in fallback.

A template that never reads ``tools`` would drop them silently, so by default such a call is
refused (``ToolsNotRendered``). With the fallback (the consumer's ``--tool-fallback``), the
conversation is rewritten before the template renders it, into what the template does render:

- the tools go into the system message (added first when there is none), after its text:
  ``# Tools`` and each tool's JSON schema on a line of its own inside ``<tools></tools>``,
  then how to call one: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  (``FALLBACK_INSTRUCTIONS``);
- an assistant turn's tool calls are written after its text as such blocks (the arguments as
  an object, one block per call, each on its own line), the way the model is asked to write
  them, so a turn the model wrote renders back as it wrote it;
- tool results are a user turn, each result inside ``<tool_response></tool_response>``,
  consecutive results in one turn.

The reply is parsed as Hermes tool calls (formats/toolcalls.py). A small model is not trained
on this format: it has to learn it, which is what RL on a tool-using task does.
"""

from __future__ import annotations

import json
from typing import Any

FALLBACK_INSTRUCTIONS = (
    "# Tools\n\nYou may call functions to help with the user's request. Their signatures, "
    "within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a function, write a "
    'JSON object with its name and arguments within <tool_call></tool_call> tags:\n<tool_call>\n{{"name": '
    '<function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def tools_text(tools: list[dict]) -> str:
    return FALLBACK_INSTRUCTIONS.format(
        tools="\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    )


def _call_block(call: dict) -> str:
    function = call.get("function") or {}
    arguments: Any = function.get("arguments", {})
    if isinstance(arguments, str):  # OpenAI's JSON string: as the object it encodes
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    payload = {"name": function.get("name"), "arguments": arguments}
    return f"<tool_call>\n{json.dumps(payload, ensure_ascii=False)}\n</tool_call>"


def with_tools_in_text(messages: list[dict], tools: list[dict]) -> list[dict]:
    """``messages`` rewritten so that a template without tool support shows the tools, the
    calls and their results (the module's docstring)."""
    out: list[dict] = []
    described = tools_text(tools)
    if messages and messages[0].get("role") == "system":
        first = messages[0].get("content") or ""
        out.append({**messages[0], "content": f"{first}\n\n{described}" if first else described})
        rest = messages[1:]
    else:
        out.append({"role": "system", "content": described})
        rest = messages
    for message in rest:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_call_block(call) for call in message["tool_calls"]]
            text = message.get("content") or ""
            content = "\n".join([text, *blocks] if text else blocks)
            rewritten = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**rewritten, "content": content})
        elif role == "tool":
            block = f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append(message)
    return [{k: v for k, v in m.items() if k != "_tool_results"} for m in out]
