"""A streamed generation's text, handed on as it grows: what a chunk may say, and when.

The chunks' texts must add up to a prefix of the call's final text (``GenerateChunk``), and an
engine's text mid-stream is not always that: it may end in half a character (U+FFFD until the
next token's bytes come), or in the first characters of a stop string that the end of the
generation cuts off again (SGLang and vLLM trim a matched stop string only once it is whole).
``HeldText`` (formats/incremental.py) holds those back until the next text settles them;
``IncrementalDecode`` decodes the ids of vLLM's token route, which answers ids only.
"""

from __future__ import annotations

from typing import Any

from agentarium.formats import partial_suffix


def stop_strings(sampling: dict[str, Any]) -> list[str]:
    """The request's stop strings (``sampling["stop"]``: one string or a list)."""
    stop = sampling.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop or () if isinstance(s, str) and s]


def trim_stop(text: str, stop: str) -> str:
    """``text`` cut where the stop string ``stop`` begins: at its first whole occurrence, else
    before a tail that is a proper prefix of it (the text an engine streamed before the token
    that completed the stop, which its last chunk no longer repeats)."""
    found = text.find(stop)
    if found != -1:
        return text[:found]
    return text[: len(text) - partial_suffix(text, [stop])]


def chunk_spans(starts: list[tuple[str, int]], tokens: int) -> list[dict[str, Any]]:
    """Per-chunk versions (``(version, first token)``, one entry per change) as the engines'
    ``weight_versions`` list (``[{version, start, end}]``), for ``weight_spans()`` to check."""
    ends = [start for _, start in starts[1:]] + [tokens]
    return [
        {"version": version, "start": start, "end": end}
        for (version, start), end in zip(starts, ends, strict=True)
    ]
