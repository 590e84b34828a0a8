"""A streamed generation's text, handed on as it grows: what a chunk may say, and when.

The chunks' texts must add up to a prefix of the call's final text (``GenerateChunk``), and an
engine's text mid-stream is not always that: it may end in half a character (U+FFFD until the
next token's bytes come), or in the first characters of a stop string that the end of the
generation cuts off again (SGLang and vLLM trim a matched stop string only once it is whole).
``HeldText`` holds those back until the next text settles them. ``IncrementalDecode`` is the
text of ids decoded here (vLLM's token route answers ids only), a few tokens at a time rather
than the whole reply again for every chunk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

_INCOMPLETE = "\ufffd"  # what a decoder writes for bytes that are not a whole character yet


def stop_strings(sampling: dict[str, Any]) -> list[str]:
    """The request's stop strings (``sampling["stop"]``: one string or a list)."""
    stop = sampling.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop or () if isinstance(s, str) and s]


class HeldText:
    """The part of a growing text that may be handed on: ``release(text)`` (the whole text so
    far) returns what is new since the last release, less a tail that could still change or
    be cut: a trailing incomplete character, a suffix that is a proper prefix of a stop
    string, or a whole stop string and what follows it."""

    __slots__ = ("stops", "sent")

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.sent = 0  # characters of the text handed on

    def release(self, text: str) -> str:
        whole = len(text)
        while whole > self.sent and text[whole - 1] == _INCOMPLETE:
            whole -= 1
        end = whole
        for stop in self.stops:
            found = text.find(stop, self.sent, whole)
            if found != -1:
                end = min(end, found)
            for k in range(min(len(stop) - 1, whole - self.sent), 0, -1):
                if text.endswith(stop[:k], self.sent, whole):
                    end = min(end, whole - k)
                    break
        if end <= self.sent:
            return ""
        piece = text[self.sent : end]
        self.sent = end
        return piece


def trim_stop(text: str, stop: str) -> str:
    """``text`` cut where the stop string ``stop`` begins: at its first whole occurrence, else
    before a tail that is a proper prefix of it (the text an engine streamed before the token
    that completed the stop, which its last chunk no longer repeats)."""
    found = text.find(stop)
    if found != -1:
        return text[:found]
    for k in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:k]):
            return text[:-k]
    return text


class IncrementalDecode:
    """The text of a growing list of ids, decoded ``decode(ids)`` a window at a time (as vLLM's
    own detokenizer does): the window starts a few tokens back so a tokenizer that spells a
    token by its neighbours (a leading space) decodes it as in the whole; text whose last
    character is incomplete waits for the next ids. ``text`` is what is decoded so far."""

    __slots__ = ("decode", "ids", "text", "_prefix", "_read")

    def __init__(self, decode: Callable[[Sequence[int]], str]) -> None:
        self.decode = decode
        self.ids: list[int] = []
        self.text = ""
        self._prefix = 0  # the window's first id
        self._read = 0  # ids before it are in ``text``

    def add(self, ids: Sequence[int]) -> str:
        """Append ``ids``; returns ``text``."""
        self.ids.extend(ids)
        if len(self.ids) == self._read:
            return self.text
        known = self.decode(self.ids[self._prefix : self._read]) if self._read else ""
        window = self.decode(self.ids[self._prefix :])
        if len(window) > len(known) and not window.endswith(_INCOMPLETE):
            self.text += window[len(known) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text


def chunk_spans(starts: list[tuple[str, int]], tokens: int) -> list[dict[str, Any]]:
    """Per-chunk versions (``(version, first token)``, one entry per change) as the engines'
    ``weight_versions`` list (``[{version, start, end}]``), for ``weight_spans()`` to check."""
    ends = [start for _, start in starts[1:]] + [tokens]
    return [
        {"version": version, "start": start, "end": end}
        for (version, start), end in zip(starts, ends, strict=True)
    ]
