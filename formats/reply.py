"""A generated reply split into reasoning, content and tool calls, by the model's formats.

Reasoning comes off first (formats/reasoning.py), and tool calls are parsed in the content
alone (formats/toolcalls.py): a call drafted inside the reasoning is not a call. gpt-oss's
harmony format carries both in its channels (formats/harmony.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .harmony import split_harmony
from .reasoning import split_reasoning
from .toolcalls import ToolCallError, parse_tool_calls


@dataclass(frozen=True)
class ParsedReply:
    reasoning: str | None
    content: str
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


def parse_reply(
    text: str,
    *,
    tool_format: str | None = "hermes",
    reasoning_format: str = "none",
    tools: list[dict] | None = None,
    opened: bool = False,
) -> ParsedReply:
    """``text`` split by the formats; ``tool_format`` None (or no ``tools`` offered) parses
    no calls; ``opened``: the prompt ended inside an open reasoning block."""
    if tool_format == "harmony" or reasoning_format == "harmony":
        split = split_harmony(text)
        if not tools:
            content = split.content
            return ParsedReply(split.reasoning, content)
        return ParsedReply(split.reasoning, split.content, split.tool_calls, split.errors)
    reasoned = split_reasoning(text, reasoning_format, opened=opened)
    if not tools or tool_format is None:
        return ParsedReply(reasoned.reasoning, reasoned.content)
    parsed = parse_tool_calls(reasoned.content, tool_format, tools=tools)
    return ParsedReply(reasoned.reasoning, parsed.content, parsed.tool_calls, parsed.errors)
