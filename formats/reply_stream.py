"""A reply parsed while it is generated: the reasoning and content deltas that are already sure.

``parse_reply`` splits a whole reply. A stream cannot wait for the whole, and cannot take back
what it sent, so ``ReplyStream`` hands on only text that the final parse will keep as it is:
it parses the text so far with the end held back, and sends what grew.

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
from .reasoning import THINK_CLOSE, THINK_OPEN, split_reasoning
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

    def feed(self, piece: str) -> list[TextDelta]:
        """The deltas ``piece`` makes sure (possibly none)."""
        self.text += piece
        if self.whole or not piece:
            return []
        safe = self.text[: self._safe_end()]
        split = split_reasoning(safe, self.reasoning_format, opened=self.opened)
        out: list[TextDelta] = []
        if split.reasoning is not None and not self.sent["content"]:
            self._grow("reasoning", split.reasoning.rstrip(), out)
        if split.content and not self._held_content(split.content):
            self._grow("content", split.content.rstrip(), out)
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

    def _grow(self, kind: str, target: str, out: list[TextDelta]) -> None:
        sent = self.sent[kind]
        if len(target) > len(sent) and target.startswith(sent):
            out.append(TextDelta(kind, target[len(sent) :]))
            self.sent[kind] = target

    def _safe_end(self) -> int:
        """Where the text that cannot change any more ends."""
        text = self.text
        end = len(text)
        for marker in self.calls_at:
            at = text.find(marker)
            if at != -1:
                end = min(end, at)
        held = partial_suffix(text, self.markers, 0, end)
        return end - held

    def _held_content(self, content: str) -> bool:
        """Llama 3 writes a call as the whole content, a JSON object: hold such content."""
        if self.tool_format != "llama3_json":
            return False
        start = content.lstrip()
        return start.startswith("{") or PYTHON_TAG.startswith(start[: len(PYTHON_TAG)])
