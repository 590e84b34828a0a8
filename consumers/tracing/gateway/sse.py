"""Server-sent events for streamed replies, and the one way a streamed call is served.

A reply streams as it is generated: the tracing client hands on each piece of reasoning or
content text that is sure (``TracingLLM.chat(on_delta=...)``, ``formats.ReplyStream``: text that
could still turn out to be a tool call or a reasoning marker is held back), and ``ReplyWriter``
turns those pieces into the API's events as they come: the API's opening events before the
first piece, a block (Anthropic's content block, a Responses output item; Chat Completions has
none) opened when the kind of text changes, its deltas, and once the call is over its tool
calls (whole: a call is only known to parse once the reply has ended), its finish reason and
usage. The deltas add up to the recorded message exactly. A backend that cannot stream
(``OpenAICompatBackend``) gives every piece at the end: the same events, all at once.

The stream opens (HTTP 200) at the first piece, or when the call has run ``OPEN_AFTER_S``
without one; a call that fails before either is answered with its HTTP status, as an
unstreamed request would be. While nothing is sent, the API's keep-alive (an SSE comment,
Anthropic's ``ping``) goes out every ``KEEPALIVE_S``. A client that goes away cancels the call
(the proxy cancels its handler), which aborts the engine's request.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any

import orjson
from aiohttp import web

from agentarium.formats import TextDelta

from ..llm import ChatResult
from .errors import GatewayError

OPEN_AFTER_S = 1.0
KEEPALIVE_S = 10.0
DELTA_CHARS = 16  # characters per delta at most: a reply given whole still arrives in pieces

COMMENT_KEEPALIVE = b": keep-alive\n\n"

OnDelta = Callable[[TextDelta], None]


def event(data: Any, name: str | None = None) -> bytes:
    """One SSE event: ``event: <name>`` when the API names its events, then ``data: <json>``."""
    head = b"event: " + name.encode() + b"\n" if name else b""
    return head + b"data: " + orjson.dumps(data) + b"\n\n"


def deltas(text: str, size: int = DELTA_CHARS) -> list[str]:
    """``text`` in pieces whose concatenation is ``text`` (none for an empty text)."""
    return [text[i : i + size] for i in range(0, len(text), size)]


@dataclass
class Block:
    """One part of a streamed reply: its reasoning, its text, or one tool call."""

    kind: str  # "reasoning" | "text" | "tool_call"
    index: int  # among the reply's blocks
    ordinal: int  # among its kind's (the tool call's index, in Chat Completions)
    text: str = ""  # what its deltas carried (a tool call's: its arguments)
    call: dict | None = None  # the tool call (OpenAI's shape), for "tool_call"
    id: str = ""  # the API's id for it, where the API names blocks


def blocks_of(result: ChatResult) -> list[Block]:
    """A finished reply's blocks, as a stream of it ends with them: its reasoning (when the
    model reasoned), its text (when it wrote some, or nothing else), then its tool calls."""
    parts: list[tuple[str, str, dict | None]] = []
    if result.reasoning is not None:
        parts.append(("reasoning", result.reasoning, None))
    if result.content or not result.tool_calls:
        parts.append(("text", result.content, None))
    parts += [("tool_call", c["function"]["arguments"], c) for c in result.tool_calls]
    blocks: list[Block] = []
    for kind, text, call in parts:
        ordinal = sum(1 for b in blocks if b.kind == kind)
        blocks.append(Block(kind, len(blocks), ordinal, text=text, call=call))
    return blocks


class StreamShape:
    """What one API writes for a streamed reply; each API module subclasses it."""

    keepalive: bytes = COMMENT_KEEPALIVE

    def refusal(self, error: GatewayError) -> web.StreamResponse:
        """The answer when the call failed before the stream opened."""
        raise NotImplementedError

    def head(self, result: ChatResult | None) -> Iterable[bytes]:
        """The events before the first block (``result`` None: the reply is still coming)."""
        raise NotImplementedError

    def open(self, block: Block) -> Iterable[bytes]:
        raise NotImplementedError

    def delta(self, block: Block, piece: str) -> Iterable[bytes]:
        raise NotImplementedError

    def close(self, block: Block) -> Iterable[bytes]:
        raise NotImplementedError

    def tail(self, result: ChatResult, blocks: list[Block]) -> Iterable[bytes]:
        """The events after the last block: the finish, the usage, the end."""
        raise NotImplementedError

    def failure(self, error: GatewayError, *, started: bool) -> Iterable[bytes]:
        """The in-stream error once the stream is open (``started``: the head was sent)."""
        raise NotImplementedError

    def events(self, result: ChatResult) -> Iterable[bytes]:
        """The whole event sequence of a finished call, as one stream of it sends it."""
        writer = ReplyWriter(self)
        out = [e for delta in _text_deltas(result) for e in writer.delta(delta)]
        return [*out, *writer.finish(result)]


def _text_deltas(result: ChatResult) -> list[TextDelta]:
    out = []
    if result.reasoning:
        out.append(TextDelta("reasoning", result.reasoning))
    if result.content:
        out.append(TextDelta("content", result.content))
    return out


class ReplyWriter:
    """Turns a reply's text deltas, then its result, into one API's events (the module
    docstring); keeps the blocks it opened, in order, for the API's final objects."""

    def __init__(self, shape: StreamShape) -> None:
        self.shape = shape
        self.blocks: list[Block] = []
        self.started = False
        self._open: Block | None = None

    def delta(self, delta: TextDelta) -> list[bytes]:
        kind = "reasoning" if delta.kind == "reasoning" else "text"
        out = self._start(None)
        block = self._switch(kind, out)
        for piece in deltas(delta.text):
            block.text += piece
            out.extend(self.shape.delta(block, piece))
        return out

    def finish(self, result: ChatResult) -> list[bytes]:
        out = self._start(result)
        kinds = {block.kind for block in self.blocks}
        if result.reasoning is not None and not self.blocks:  # an empty reasoning: still a block
            self._switch("reasoning", out)
        if not result.tool_calls and "text" not in kinds:  # an empty answer: still a text block
            self._switch("text", out)
        if self._open is not None:
            out.extend(self.shape.close(self._open))
            self._open = None
        for call in result.tool_calls:
            block = self._add("tool_call", call=call)
            out.extend(self.shape.open(block))
            for piece in deltas(call["function"]["arguments"]):
                block.text += piece
                out.extend(self.shape.delta(block, piece))
            out.extend(self.shape.close(block))
        out.extend(self.shape.tail(result, self.blocks))
        return out

    def _start(self, result: ChatResult | None) -> list[bytes]:
        if self.started:
            return []
        self.started = True
        return list(self.shape.head(result))

    def _switch(self, kind: str, out: list[bytes]) -> Block:
        block = self._open
        if block is not None and block.kind == kind:
            return block
        if block is not None:
            out.extend(self.shape.close(block))
        block = self._open = self._add(kind)
        out.extend(self.shape.open(block))
        return block

    def _add(self, kind: str, call: dict | None = None) -> Block:
        ordinal = sum(1 for b in self.blocks if b.kind == kind)
        block = Block(kind, len(self.blocks), ordinal, call=call)
        self.blocks.append(block)
        return block


async def serve_stream(
    request: web.Request,
    call: Callable[[OnDelta], Awaitable[ChatResult]],
    shape: StreamShape,
) -> web.StreamResponse:
    """Run ``call(on_delta)`` and stream its reply in ``shape``; see the module docstring."""
    writer = ReplyWriter(shape)
    pending: list[bytes] = []
    woken = asyncio.Event()

    def on_delta(delta: TextDelta) -> None:
        pending.extend(writer.delta(delta))
        woken.set()

    task = asyncio.ensure_future(call(on_delta))
    try:
        await _first(task, woken, OPEN_AFTER_S)
        if task.done() and not pending:
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
        while not task.done():
            if pending:
                data = b"".join(pending)
                pending.clear()
                await response.write(data)
            woken.clear()
            if not await _first(task, woken, KEEPALIVE_S):
                await response.write(shape.keepalive)
        try:
            result = task.result()
        except GatewayError as error:
            chunks: Iterable[bytes] = [*pending, *shape.failure(error, started=writer.started)]
        else:
            chunks = [*pending, *writer.finish(result)]
        await response.write(b"".join(chunks))
        await response.write_eof()
        return response
    finally:
        if not task.done():  # the client went away or the consumer is stopping
            task.cancel()


async def _first(task: asyncio.Future, woken: asyncio.Event, timeout: float) -> bool:
    """Wait until ``task`` ends or ``woken`` is set, ``timeout`` at most; False on timeout."""
    if task.done() or woken.is_set():
        return True
    waiter = asyncio.ensure_future(woken.wait())
    try:
        done, _ = await asyncio.wait({task, waiter}, timeout=timeout, return_when="FIRST_COMPLETED")
    finally:
        waiter.cancel()
    return bool(done)
