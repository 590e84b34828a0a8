"""Incremental detokenization: the text each step adds to a streamed request's output.

Decoding the whole output at every step costs O(length) per step on the event loop, for every
streamed row. Instead each step decodes a short window, vLLM's way: from the token where the
text before last was read (context, so a decoder that treats a first token specially, such as
sentencepiece's leading space, does so in both decodes) to the newest token, and keeps what it
adds past the same window's decode without the new tokens. Two things are held back, so that
the deltas add up to exactly the text decoded at once (Sequence.text()):

- an incomplete character: a window ending in U+FFFD waits for the bytes that complete it;
- a suffix that could begin a stop string: if the string completes, that text is cut.

The final text is compared with what was sent at the end (`finish`); a tokenizer whose
decoding of a window is not the matching slice of the whole would show there. Byte-level BPE
(the tiny model's, SmolLM2's, Qwen's, Llama 3's) decodes bytes, and a window starts where a
character ends, so its windows add up; tests/test_engine_stream.py fuzzes that, and the same
for a sentencepiece-style (Metaspace) decoder.
"""

from __future__ import annotations

from collections.abc import Callable

REPLACEMENT = "\ufffd"  # what the decoder writes for the bytes of an incomplete character


class IncrementalText:
    """Text deltas of a growing list of output ids; see the module docstring."""

    def __init__(self, decode: Callable[[list[int]], str], stops: tuple[str, ...] = ()) -> None:
        self._decode = decode
        self._stops = stops  # empty under no_stop_trim: the text keeps a matched stop string
        self._prefix = 0  # window start: the read offset before the last one
        self._read = 0  # the text of the tokens before it has been taken (sent or held)
        self._held = ""  # taken but not sent: it may begin a stop string
        self._sent: list[str] = []
        self.diverged = False

    def advance(self, ids: list[int], end: int) -> str:
        """The text that `ids[:end]` add to what was returned before (maybe "")."""
        before = self._decode(ids[self._prefix : self._read])
        window = self._decode(ids[self._prefix : end])
        if len(window) > len(before) and not window.endswith(REPLACEMENT):
            self._held += window[len(before) :]
            self._prefix, self._read = self._read, end
        keep = _stop_prefix_len(self._held, self._stops)
        out = self._held[: len(self._held) - keep]
        self._held = self._held[len(self._held) - keep :]
        if out:
            self._sent.append(out)
        return out

    def finish(self, text: str) -> str:
        """What is left of the request's final `text` after the deltas returned so far.

        If they are not a prefix of it (`diverged` is then set), they cannot be taken back:
        the rest after their longest common prefix is returned.
        """
        sent = "".join(self._sent)
        if text.startswith(sent):
            return text[len(sent) :]
        self.diverged = True
        common = 0
        for a, b in zip(sent, text, strict=False):
            if a != b:
                break
            common += 1
        return text[common:]


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string.

    Text before that suffix cannot be cut: a stop string starting there would have ended
    inside `text`, and a step that completes one finishes the request at once.
    """
    longest = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:k]):
                longest = k
                break
    return longest
