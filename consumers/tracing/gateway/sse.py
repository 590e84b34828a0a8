"""Server-sent events for streamed replies, and the one way a streamed call is served.

The tracing client returns a call once it is over (its token ids, logprobs and parsed tool
calls are only whole then), so a streamed reply is written from the finished call: every event
of the API's sequence, the text cut into deltas that add up to exactly the recorded text. While
the call runs the connection is kept alive: a call that ends within ``OPEN_AFTER_S`` is answered
at once (a refusal then gets its HTTP status, as an unstreamed request would); a longer one opens
the stream (200) and sends the API's keep-alive (an SSE comment, Anthropic's ``ping``) every
``KEEPALIVE_S`` until the call ends, then its events, or the API's in-stream error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import Any

import orjson
from aiohttp import web

from ..llm import ChatResult
from .errors import GatewayError

OPEN_AFTER_S = 1.0
KEEPALIVE_S = 10.0
DELTA_CHARS = 16  # characters per text delta: enough events to exercise a client's assembly

COMMENT_KEEPALIVE = b": keep-alive\n\n"


def event(data: Any, name: str | None = None) -> bytes:
    """One SSE event: ``event: <name>`` when the API names its events, then ``data: <json>``."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def deltas(text: str, size: int = DELTA_CHARS) -> list[str]:
    """``text`` in pieces whose concatenation is ``text`` (none for an empty text)."""
    return [text[i : i + size] for i in range(0, len(text), size)]


class StreamShape:
    """What one API writes around a streamed call; each API module subclasses it."""

    keepalive: bytes = COMMENT_KEEPALIVE

    def refusal(self, error: GatewayError) -> web.StreamResponse:
        """The answer when the call failed before the stream opened."""
        raise NotImplementedError

    def events(self, result: ChatResult) -> Iterable[bytes]:
        """The whole event sequence of a finished call."""
        raise NotImplementedError

    def failure(self, error: GatewayError) -> Iterable[bytes]:
        """The in-stream error once the stream is open."""
        raise NotImplementedError


async def serve_stream(
    request: web.Request, call: Callable[[], Awaitable[ChatResult]], shape: StreamShape
) -> web.StreamResponse:
    """Run ``call`` and stream its result in ``shape``; see the module docstring."""
    task = asyncio.ensure_future(call())
    try:
        done, _ = await asyncio.wait({task}, timeout=OPEN_AFTER_S)
        if done:
            error = task.exception()
            if isinstance(error, GatewayError):
                return shape.refusal(error)
            if error is not None:  # not a refusal: the handler's failure, before any byte is sent
                raise error
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # a proxy in front must not hold the events back
            }
        )
        await response.prepare(request)
        while not done:
            await response.write(shape.keepalive)
            done, _ = await asyncio.wait({task}, timeout=KEEPALIVE_S)
        try:
            result = task.result()
        except GatewayError as error:
            chunks: Iterable[bytes] = shape.failure(error)
        else:
            chunks = shape.events(result)
        await response.write(b"".join(chunks))
        await response.write_eof()
        return response
    finally:
        if not task.done():  # the client went away or the consumer is stopping
            task.cancel()
