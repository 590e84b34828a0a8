"""The text of a reply that is still being generated: decoded as its ids come, and held back
where the rest of it may still change it. Shared by the local engine (its streamed chunks) and
the consumer's backends (chunks they decode themselves, or receive from an engine that does
not hold back).

- ``IncrementalDecode``: the text of a growing list of ids, decoded a window at a time (as
  vLLM's and SGLang's detokenizers do) instead of the whole reply again for every step. The
  window starts at the read offset before last, so a decoder that spells a token by its
  neighbour (sentencepiece's leading space) decodes it as in the whole; a window ending in an
  unfinished character (U+FFFD) waits for the next ids.
- ``HeldText``: what of a growing text may be handed on, less a tail that could still change or
  be cut: an unfinished character, a suffix that may begin a stop string (the engines trim a
  matched stop string only once it is whole), or a whole stop string and what follows it.
- ``partial_suffix``: the length of the longest suffix of a text that is a proper prefix of one
  of some strings (a stop string's, a marker's start).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

INCOMPLETE = "\ufffd"  # what a decoder writes for the bytes of an unfinished character


def partial_suffix(
    text: str, strings: Sequence[str], start: int = 0, end: int | None = None
) -> int:
    """The length of the longest suffix of ``text[start:end]`` that is a proper prefix of one of
    ``strings``."""
    end = len(text) if end is None else end
    longest = 0
    for string in strings:
        for size in range(min(len(string) - 1, end - start), longest, -1):
            if text.endswith(string[:size], start, end):
                longest = size
                break
    return longest


class IncrementalDecode:
    """The text of a growing list of ids (the module docstring); ``text`` is what is decoded
    so far."""

    __slots__ = ("decode", "ids", "text", "_prefix", "_read")

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
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
        if len(window) > len(known) and not window.endswith(INCOMPLETE):
            self.text += window[len(known) :]
            self._prefix, self._read = self._read, len(self.ids)
        return self.text


class HeldText:
    """``release(text)`` (the whole text so far) returns what is new since the last release,
    less the tail that could still change or be cut (the module docstring)."""

    __slots__ = ("stops", "sent")

    def __init__(self, stops: Sequence[str] = ()) -> None:
        self.stops = [s for s in stops if s]
        self.sent = 0  # characters of the text handed on

    def release(self, text: str) -> str:
        whole = len(text)
        while whole > self.sent and text[whole - 1] == INCOMPLETE:
            whole -= 1
        end = whole
        for stop in self.stops:
            found = text.find(stop, self.sent, whole)
            if found != -1:
                end = min(end, found)
        end = min(end, whole - partial_suffix(text, self.stops, self.sent, whole))
        if end <= self.sent:
            return ""
        piece = text[self.sent : end]
        self.sent = end
        return piece
