"""Observation caps: what a worker does with an observation bigger than it may send.

A reply must stay well under the server's ``max_payload`` (a bigger one is refused by the
server, and the client would only see a timeout), so the worker caps every observation at
``max_observation_bytes`` of encoded reply. Over the cap, the longest message texts are cut
(from their end) and each cut text ends with a marker saying how much was cut, and the reply
says ``truncated`` (``StepResult.truncated``; ``Observation.info["truncated"]``). What cannot
be cut (tool definitions, info, a reply made of many small messages) raises ``TooLarge``:
the worker answers that as the environment's error.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TypeVar

from agentarium.schemas import Observation, StepResult, encode

M = TypeVar("M", Observation, StepResult)

MARKER = "\n[... {cut} bytes cut: the observation was over this worker's limit of {cap} bytes]"
# A cut text keeps at least this much, so a single huge message cannot erase every other one.
_MIN_KEEP = 64


class TooLarge(ValueError):
    """An observation that stays over the cap after every text was cut."""


def _texts(messages: list) -> list[tuple[int, int | None, str]]:
    """(message index, content part index or None, text) of every string content."""
    found: list[tuple[int, int | None, str]] = []
    for i, message in enumerate(messages):
        content = message.get("content")
        if isinstance(content, str):
            found.append((i, None, content))
        elif isinstance(content, list):
            for j, part in enumerate(content):
                if isinstance(part, dict) and isinstance(part.get("text"), str):
                    found.append((i, j, part["text"]))
    return found


def _replace(messages: list, i: int, j: int | None, text: str) -> list:
    out = list(messages)
    message = dict(out[i])
    if j is None:
        message["content"] = text
    else:
        parts = list(message["content"])
        parts[j] = {**parts[j], "text": text}
        message["content"] = parts
    out[i] = message
    return out


def _cut(text: str, drop: int, cap: int) -> str:
    """``text`` less at least ``drop`` bytes (UTF-8) from its end, plus the marker."""
    raw = text.encode()
    keep = max(_MIN_KEEP, len(raw) - drop)
    kept = raw[:keep].decode(errors="ignore")
    return kept + MARKER.format(cut=len(raw) - len(kept.encode()), cap=cap)


def cap_messages(message: M, cap: int, rebuild: Callable[[M, list], M]) -> tuple[M, bool]:
    """``message`` whose ``messages`` are cut until its encoding fits ``cap`` bytes; and
    whether anything was cut."""
    size = len(encode(message))
    if size <= cap:
        return message, False
    messages = list(message.messages)
    for _ in range(len(_texts(messages)) + 1):
        over = size - cap
        candidates = [t for t in _texts(messages) if len(t[2].encode()) > _MIN_KEEP + 256]
        if not candidates:
            break
        i, j, text = max(candidates, key=lambda t: len(t[2].encode()))
        drop = over + len(MARKER) + 32  # the marker itself takes room
        messages = _replace(messages, i, j, _cut(text, drop, cap))
        message = rebuild(message, messages)
        size = len(encode(message))
        if size <= cap:
            return message, True
    raise TooLarge(
        f"the observation is {size} bytes encoded, over this worker's limit of {cap} bytes, "
        "even with its texts cut: send smaller tools, info or fewer messages"
    )


def cap_step_result(result: StepResult, cap: int) -> StepResult:
    capped, cut = cap_messages(
        result, cap, lambda r, messages: dataclasses.replace(r, messages=messages)
    )
    return dataclasses.replace(capped, truncated=True) if cut else capped


def cap_observation(observation: Observation, cap: int) -> Observation:
    capped, cut = cap_messages(
        observation, cap, lambda o, messages: dataclasses.replace(o, messages=messages)
    )
    if not cut:
        return capped
    return dataclasses.replace(capped, info={**capped.info, "truncated": True})
