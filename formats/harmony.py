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

_START, _MESSAGE, _ENDS = "<|start|>", "<|message|>", ("<|end|>", "<|call|>", "<|return|>")
_CHANNEL = re.compile(r"<\|channel\|>\s*([\w-]+)")
_RECIPIENT = re.compile(r"to=([^\s<]+)")


def _messages(text: str) -> list[tuple[str, str, str]]:
    """(header, body, raw) of each message, in one pass over the markers; text outside any
    message comes as a message with no header (kept as content)."""
    out: list[tuple[str, str, str]] = []
    position = 0
    while position < len(text):
        marker = text.find(_MESSAGE, position)
        if marker == -1:
            out.append(("", text[position:], text[position:]))
            break
        # the header: from the last <|start|> (or the last message's end) to <|message|>
        start = text.rfind(_START, position, marker)
        header_from = start + len(_START) if start != -1 else position
        if start > position:  # text between a message's end and the next <|start|>
            out.append(("", text[position:start], text[position:start]))
        body_from = marker + len(_MESSAGE)
        ends = [(text.find(e, body_from), e) for e in _ENDS]
        nxt = text.find(_START, body_from)
        if nxt != -1:
            ends.append((nxt, ""))
        found = [(at, e) for at, e in ends if at != -1]
        at, end = min(found) if found else (len(text), "")
        raw = text[start if start != -1 else position : at + len(end)]
        out.append((text[header_from:marker], text[body_from:at], raw))
        position = at + len(end)
    return out


@dataclass(frozen=True)
class HarmonyReply:
    reasoning: str | None
    content: str
    tool_calls: list[dict] = field(default_factory=list)
    errors: list[ToolCallError] = field(default_factory=list)


def split_harmony(text: str) -> HarmonyReply:
    """``text`` (decoded with its special tokens) split into reasoning, content and calls."""
    if _MESSAGE not in text:
        return HarmonyReply(None, text)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict] = []
    errors: list[ToolCallError] = []
    for header, body, raw in _messages(text):
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        if recipient and recipient.group(1).startswith("functions."):
            name = recipient.group(1).removeprefix("functions.")
            try:
                calls.append(_call(name, json.loads(body)))
            except ValueError as exc:
                errors.append(ToolCallError(raw=raw, message=str(exc)))
                content.append(raw)
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body.strip())
        else:  # final, commentary to the user, or text outside any message
            content.append(body.strip())
    return HarmonyReply(
        reasoning="\n\n".join(r for r in reasoning if r) or None,
        content="\n\n".join(c for c in content if c),
        tool_calls=calls,
        errors=errors,
    )
