"""gpt-oss's harmony format: one reply is several messages on channels.

After the prompt's ``<|start|>assistant``, gpt-oss writes messages of the form
``<|channel|>CHANNEL[ to=RECIPIENT][ <|constrain|>json]<|message|>BODY`` ended by ``<|end|>``
(more follows, after ``<|start|>assistant``), ``<|call|>`` (a tool call: the turn stops for its
result) or ``<|return|>`` (the turn's end). The recipient may also stand before the channel
(``<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>``). The channels:

- ``analysis``: the chain of thought, the reply's reasoning;
- ``commentary`` to ``functions.NAME``: a tool call whose body is its JSON arguments; without
  a recipient, a preamble to the user (content);
- ``final``: the answer (content).

Text without any ``<|message|>`` is all content (a model that ignored the format).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from .toolcalls import ToolCallError, _call

_MESSAGE = re.compile(
    r"(?:<\|start\|>)?(?P<header>(?:(?!<\|message\|>|<\|start\|>).)*)<\|message\|>"
    r"(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|(?=<\|start\|>)|\Z)",
    re.DOTALL,
)
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


@dataclass(frozen=True)
class HarmonyReply:
    reasoning: str | None
    content: str
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


def split_harmony(text: str) -> HarmonyReply:
    """``text`` (decoded with its special tokens) split into reasoning, content and calls."""
    if "<|message|>" not in text:
        return HarmonyReply(None, text)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict] = []
    errors: list[ToolCallError] = []
    for match in _MESSAGE.finditer(text):
        header, body = match.group("header"), match.group("body")
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            name = recipient.group(1).removeprefix("functions.")
            try:
                calls.append(_call(name, json.loads(body)))
            except ValueError as exc:
                errors.append(ToolCallError(raw=match.group(0), message=str(exc)))
                content.append(match.group(0))
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body.strip())
        else:  # final, or commentary to the user
            content.append(body.strip())
    return HarmonyReply(
        reasoning="\n\n".join(r for r in reasoning if r) or None,
        content="\n\n".join(c for c in content if c),
        tool_calls=calls,
        errors=errors,
    )
