"""Reasoning split from generated text: ``<think>…</think>`` as Qwen3 and DeepSeek-R1 write it.

A thinking model writes its reasoning first, in a block, then its answer. The block's markers
are plain text here (what the engine decoded), and the reply's content is what follows the
closing marker. Three shapes occur:

- ``<think>reasoning</think>answer``: the model opened the block itself (Qwen3);
- ``reasoning</think>answer``: the prompt opened it (DeepSeek-R1's and Qwen3-thinking's
  templates end the generation prompt with ``<think>``), so only the close is generated;
- ``<think>reasoning`` with no close: generation stopped inside the block (a length limit):
  all of it is reasoning and the content is empty. Told that the prompt opened the block
  (``opened``), text with no marker at all is such a case too.

Nothing inside the reasoning is parsed as a tool call (formats/toolcalls.py reads the content
alone): a model that drafts a call while thinking has not made it.

``REASONING_FORMATS``: ``think`` (the above), ``harmony`` (gpt-oss's analysis channel:
formats/harmony.py) and ``none`` (all text is content).
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
REASONING_FORMATS = ("think", "harmony", "none")


@dataclass(frozen=True)
class Reasoned:
    """Generated text split into reasoning (None: the text had none) and content."""

    reasoning: str | None
    content: str


def split_reasoning(text: str, fmt: str = "think", *, opened: bool = False) -> Reasoned:
    """``text`` split by reasoning format ``fmt``; ``opened``: the prompt ended inside an open
    ``<think>`` block (so the text starts in the reasoning)."""
    if fmt == "none":
        return Reasoned(None, text)
    if fmt == "harmony":
        from .harmony import split_harmony

        split = split_harmony(text)
        return Reasoned(split.reasoning, split.content)
    if fmt != "think":
        raise ValueError(f"unknown reasoning format {fmt!r}: one of {', '.join(REASONING_FORMATS)}")
    start = text.find(THINK_OPEN)
    close = text.find(THINK_CLOSE)
    if start != -1 and (close == -1 or start < close):
        body_from = start + len(THINK_OPEN)
        before = text[:start]
    elif close != -1 or opened:
        body_from, before = 0, ""
    else:
        return Reasoned(None, text)
    close = text.find(THINK_CLOSE, body_from)
    if close == -1:  # stopped inside the block
        return Reasoned(text[body_from:].strip(), before.strip())
    reasoning = text[body_from:close].strip()
    content = (before + text[close + len(THINK_CLOSE) :]).strip()
    return Reasoned(reasoning, content)


def detect_reasoning_format(template_source: str) -> str:
    """The reasoning format a chat template's text implies: ``harmony`` for gpt-oss's channels,
    ``think`` when it renders or opens ``<think>`` blocks, else ``none``."""
    if "<|channel|>" in template_source:
        return "harmony"
    return "think" if THINK_OPEN in template_source or THINK_CLOSE in template_source else "none"
