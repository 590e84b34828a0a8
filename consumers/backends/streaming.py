"""A streamed generation's text, handed on as it grows: what a chunk may say, and when.

The chunks' texts must add up to a prefix of the call's final text (``GenerateChunk``), and an
engine's text mid-stream is not always that: it may end in half a character (U+FFFD until the
next token's bytes come), or in the first characters of a stop string that the end of the
generation cuts off again (SGLang and vLLM trim a matched stop string only once it is whole).
``HeldText`` (formats/incremental.py) holds those back until the next text settles them;
``IncrementalDecode`` decodes the ids of vLLM's token route, which answers ids only.
``ChunkReader`` is what the engines' stream readers share (a chunk is a JSON object, an
``{"error": ...}`` one is ``ErrorChunk``).
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


class ErrorChunk(Exception):
    """A stream's ``{"error": {"message", ...}}`` chunk (SGLang's for what its unstreamed
    call refuses with 400; vLLM's with its ``code``)."""

    def __init__(self, error: Any) -> None:
        error = error if isinstance(error, dict) else {"message": str(error)}
        code = error.get("code") or error.get("status_code")
        self.status = code if isinstance(code, int) and not isinstance(code, bool) else 400
        self.text = str(error.get("message") or error)[:500]
        super().__init__(f"HTTP {self.status} in the stream: {self.text}")


class ChunkReader:
    """What every engine's stream reader shares: ``last`` is the last chunk's (set once one
    with a finish reason came), and each chunk must be a JSON object that is not an error."""

    last: Any = None

    @property
    def finished(self) -> bool:
        return self.last is not None

    @staticmethod
    def chunk_object(data: Any) -> dict[str, Any]:
        if not isinstance(data, dict):
            raise ValueError(f"a chunk that is not an object: {str(data)[:200]}")
        if "error" in data:
            raise ErrorChunk(data["error"])
        return data
