"""A reply parsed while it is generated: the reasoning and content deltas that are already sure.

``parse_reply`` splits a whole reply. A stream cannot wait for the whole, and cannot take back
what it sent, so ``ReplyStream`` hands on only text that the final parse will keep as it is:
what parsing the text so far, its end held back, would add to what was sent. It does not
parse the whole text again at every piece, which made a long reply's cost quadratic (32,000
pieces took 3.8 s): the markers' first places are searched for once each (``_Layout``), the
reasoning and the content are ranges of the text between them (``_Source``, the parse's
stripping counted once), and a piece costs its own length and the markers'.

Held back until more text (or the end) decides it:
- a suffix that could still become a marker (``<thi``: maybe ``<think>``; ``<tool_`` maybe
  ``<tool_call>``): the tool-call and reasoning markers of the model's formats;
- everything from the start of a tool call on (tool calls are handed on whole, once the reply
  has ended: a half-written call may still fail to parse, and its text would then be content);
  with Llama 3's JSON calls, content that starts as a JSON object or ``<|python_tag|>``;
- trailing whitespace (a parse strips it where a block or a call follows);
- reasoning once content has begun (the blocks of every API come in that order);
- with gpt-oss's harmony channels, everything (its channels are split once, at the end).

Stop strings are the backend's to hold back (``GenerateChunk``): the pieces fed here never end
in a proper prefix of one. ``finish`` compares what was sent with the final parse: the rest is
sent then, and a stream whose sent text is not a prefix of the final one (a tokenizer whose
decoding is not prefix-stable) is reported as diverged rather than patched silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from .incremental import partial_suffix
from .reasoning import THINK_CLOSE, THINK_OPEN
from .toolcalls import DS_CALLS_BEGIN, MISTRAL_CALLS, PYTHON_TAG, TOOL_CALL_OPEN

# Where each tool-call format's calls begin; llama3_json is the whole content (see _held_content).
CALL_MARKERS = {
    "hermes": (TOOL_CALL_OPEN,),
    "qwen3_coder": (TOOL_CALL_OPEN,),
    "mistral": (MISTRAL_CALLS,),
    "deepseek_v3": (DS_CALLS_BEGIN,),
    "llama3_json": (PYTHON_TAG,),
}


@dataclass(frozen=True, slots=True)
class TextDelta:
    """Text that grew in the reply's ``reasoning`` or ``content``."""

    kind: str  # "reasoning" | "content"
    text: str


class ReplyStream:
    """Feed the generated text piece by piece (``feed``), then the final parse (``finish``)."""

    def __init__(
        self,
        *,
        tool_format: str | None,
        reasoning_format: str,
        tools: bool,
        opened: bool = False,
    ) -> None:
        self.reasoning_format = reasoning_format
        self.tool_format = tool_format if tools else None
        self.opened = opened
        self.whole = tool_format == "harmony" or reasoning_format == "harmony"
        markers: list[str] = []
        if reasoning_format == "think":
            markers += [THINK_OPEN, THINK_CLOSE]
        markers += CALL_MARKERS.get(self.tool_format or "", ())
        self.markers = tuple(markers)
        self.calls_at = CALL_MARKERS.get(self.tool_format or "", ())
        self.text = ""
        self.sent = {"reasoning": "", "content": ""}
        self.diverged = False
        self._layout = _Layout(self)
        self._checks: dict[str, list] = {}  # per kind: [_Source, chars matched, refuted]

    def feed(self, piece: str) -> list[TextDelta]:
        """The deltas ``piece`` makes sure (possibly none). Its cost is that of ``piece`` and
        of the markers, not of the text so far (``_Layout``)."""
        text, self.text = self.text, ""
        text += piece  # the sole reference: CPython grows it in place
        self.text = text
        if self.whole or not piece:
            return []
        end = self._safe_end()
        reasoning, content = self._layout.at(end)
        out: list[TextDelta] = []
        if reasoning is not None and not self.sent["content"]:
            self._grow("reasoning", reasoning, out)
        if not self._held_content(content):
            self._grow("content", content, out)
        return out

    def finish(self, reasoning: str | None, content: str) -> list[TextDelta]:
        """What is left to send of the final parse's ``reasoning`` and ``content``; sets
        ``diverged`` when what was sent is not where the final text begins."""
        out: list[TextDelta] = []
        for kind, final in (("reasoning", reasoning or ""), ("content", content)):
            sent = self.sent[kind]
            if not final.startswith(sent):
                self.diverged = True
                continue
            if len(final) > len(sent):
                out.append(TextDelta(kind, final[len(sent) :]))
                self.sent[kind] = final
        return out

    def _grow(self, kind: str, source: _Source, out: list[TextDelta]) -> None:
        """Send what ``source`` (stripped) has beyond what was sent of ``kind``, once it has
        been checked to begin with what was sent (a part that once began otherwise, or whose
        text another source now makes, is checked anew: only as far as it was not yet)."""
        sent = self.sent[kind]
        check = self._checks.get(kind)
        if check is None or check[0] is not source:
            check = self._checks[kind] = [source, 0, False]  # its chars matched, refuted
        if check[2]:
            return
        if check[1] < len(sent):
            part = source.beyond(self.text, check[1], limit=len(sent) - check[1])
            if not sent.startswith(part, check[1]):
                check[2] = True
                return
            check[1] += len(part)
            if check[1] < len(sent):
                return  # not yet as long as what was sent
        grown = source.beyond(self.text, len(sent))
        if grown:
            out.append(TextDelta(kind, grown))
            self.sent[kind] = ""
            sent += grown  # the sole reference: grown in place
            self.sent[kind] = sent
            check[1] = len(sent)

    def _safe_end(self) -> int:
        """Where the text that cannot change any more ends."""
        text = self.text
        end = len(text)
        for marker in self.calls_at:
            at = self._layout.first(marker, end)
            if at != -1:
                end = min(end, at)
        held = partial_suffix(text, self.markers, 0, end)
        return end - held

    def _held_content(self, content: _Source) -> bool:
        """Llama 3 writes a call as the whole content, a JSON object: hold such content."""
        if self.tool_format != "llama3_json":
            return False
        start = content.head(self.text, len(PYTHON_TAG))
        return start.startswith("{") or PYTHON_TAG.startswith(start)


class _Source:
    """One kind's text as the parse makes it: the concatenated ``ranges`` of the reply's text,
    stripped at its end, and at its start where ``split_reasoning`` strips it (``strip``: a
    reasoning block's parts). Its leading whitespace is counted once (the ranges' starts are
    fixed while the reply grows)."""

    __slots__ = ("ranges", "strip", "_solid")

    def __init__(self, ranges: tuple[tuple[int, int], ...], strip: bool) -> None:
        self.ranges = ranges
        self.strip = strip
        self._solid = -1  # leading whitespace characters, once something else has come

    def _lead(self, text: str) -> int:
        """Its leading whitespace characters; -1 while it is whitespace alone."""
        if self._solid == -1:
            skipped = 0
            for a, b in self.ranges:
                part = text[a:b]
                solid = len(part) - len(part.lstrip())
                if solid < len(part):
                    self._solid = skipped + solid
                    break
                skipped += len(part)
        return self._solid

    def head(self, text: str, size: int) -> str:
        """Its first ``size`` characters after its leading whitespace, as the parse has it
        (trailing whitespace stripped only where the parse strips it)."""
        lead = self._lead(text)
        if lead == -1:
            return ""
        end = sum(b - a for a, b in self.ranges)
        if self.strip:
            end -= _trailing_space(text, self.ranges)
        return self._slice(text, lead, min(end, lead + size))

    def beyond(self, text: str, start: int, limit: int | None = None) -> str:
        """The stripped text from its character ``start`` on (at most ``limit`` characters)."""
        lead = self._lead(text)
        if lead == -1:
            return ""
        lead = lead if self.strip else 0
        total = sum(b - a for a, b in self.ranges) - _trailing_space(text, self.ranges)
        at = lead + start
        return self._slice(text, at, total if limit is None else min(total, at + limit))

    def _slice(self, text: str, at: int, stop: int) -> str:
        """Characters ``at`` to ``stop`` of the concatenated ranges."""
        out = []
        for a, b in self.ranges:
            size = b - a
            if at < size and at < stop:
                out.append(text[a + at : a + min(size, stop)])
            at, stop = max(at - size, 0), stop - size
        return "".join(out)


def _trailing_space(text: str, ranges: tuple[tuple[int, int], ...]) -> int:
    """Whitespace characters at the end of the concatenated ``ranges`` of ``text``."""
    count = 0
    for a, b in reversed(ranges):
        i = b
        while i > a and text[i - 1].isspace():
            i -= 1
        count += b - i
        if i > a:
            break
    return count


class _Layout:
    """Where ``split_reasoning`` would find the reasoning and the content in the text so far,
    from the markers' first places, each searched for only in the text not yet searched."""

    def __init__(self, stream: ReplyStream) -> None:
        self.stream = stream
        self.found: dict[str, int] = {}  # a marker's first place, once seen
        self.sources: dict[tuple, _Source] = {}
        self.searched: dict[str, int] = {}  # searched up to here (the marker's end)

    def first(self, marker: str, end: int) -> int:
        """``text.find(marker, 0, end)``."""
        at = self.found.get(marker, -1)
        if at == -1:
            text = self.stream.text
            since = max(0, self.searched.get(marker, 0) - len(marker) + 1)
            at = text.find(marker, since, end)
            if at == -1:
                self.searched[marker] = max(self.searched.get(marker, 0), end)
                return -1
            self.found[marker] = at
        return at if at + len(marker) <= end else -1

    def at(self, end: int) -> tuple[_Source | None, _Source]:
        """The reasoning (None: no block) and the content of ``text[:end]``, as ``_Source``s
        (``split_reasoning``'s rules for "none" and "think")."""
        if self.stream.reasoning_format != "think":
            return None, self._source("content", ((0, end),), strip=False)
        start, close = self.first(THINK_OPEN, end), self.first(THINK_CLOSE, end)
        if start != -1 and (close == -1 or start < close):
            body, before = start + len(THINK_OPEN), (0, start)
        elif close != -1 or self.stream.opened:
            body, before = 0, (0, 0)
        else:
            return None, self._source("content", ((0, end),), strip=False)
        if close == -1 or close < body:
            return self._source("reasoning", ((body, end),)), self._source("content", (before,))
        after = (close + len(THINK_CLOSE), end)
        return self._source("reasoning", ((body, close),)), self._source("content", (before, after))

    def _source(
        self, kind: str, ranges: tuple[tuple[int, int], ...], *, strip: bool = True
    ) -> _Source:
        """``kind``'s ``_Source`` of these ranges, the one already made for the same starts
        kept (its leading whitespace counted). ``strip``: whether the parse strips the text's
        start (a reply without a reasoning block keeps it)."""
        key = (kind, strip, *(a for a, _ in ranges))
        kept = self.sources.get(key)
        if kept is None:
            kept = self.sources[key] = _Source(ranges, strip)
        kept.ranges = ranges
        return kept
