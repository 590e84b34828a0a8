"""A small HTTP/1.1 client for the backends' JSON calls: pooled keep-alive connections, one
request at a time on each, bodies read whole (or as they arrive: ``stream``, below).

Why not aiohttp's client, which the rest of the project uses: an LLM call of a one-token
rollout costs the consumer ~165 us of CPU in aiohttp's request machinery (tracing hooks,
cookie jar, multidicts, a stream reader per response), as much as everything else the
rollout does; this client does the few things a ``POST /generate`` needs in a fraction of
that (docs/benchmarks.md, "Where a rollout's time goes"). What it leaves out on purpose:
pipelining, redirects, cookies, proxies from the environment (aiohttp ignores those by
default too), compression (it never asks for it), HTTP/2.

Streaming (``stream``): the head first, then the body as it arrives (chunked, a
content-length, or until the server closes), and ``events()`` reads it as server-sent events,
as SGLang and vLLM stream a generation. It takes the same connections; leaving the stream
before its end (cancelled, an exception, or the caller done with it) drops the connection,
since what is still on the way would be read as the next answer; a stream read to its end
leaves it reusable as a whole response does.

Connections: a request takes an idle connection to its host, or opens one while fewer than
``max_connections`` are open (beyond that it waits for one to come back). A connection idle
for ``keepalive_s`` is closed before a server's keep-alive timeout can race a request on it
(uvicorn, under SGLang, closes idle connections after 5 s). Failures of the connection
itself (refused, reset, closed before the whole answer, a timeout) raise ``HttpError`` or
``TimeoutError``; an HTTP error status is a ``Response`` like any other.

Every request carries the current span's W3C ``traceparent`` (when a span is current: a
rollout's ``chat`` span during its LLM call), so the engine's own spans (the local engine's,
SGLang's with ``--enable-trace``, vLLM's with ``--otlp-traces-endpoint``) join the caller's trace.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import resource
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from agentarium.broker import current_traceparent

# Sockets kept free for everything else a consumer holds open (NATS, its proxy, files).
FD_RESERVE = 512
_MAX_HEAD = 64 * 1024
# A stream's body waiting to be read, past which the socket is not read (TCP pushes back).
_STREAM_HIGH_WATER = 1 << 20


class HttpError(Exception):
    """The connection failed before a whole response arrived (nothing is known of the request)."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    headers: dict[str, str]

    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")

    def json(self) -> Any:
        return orjson.loads(self.body)


def default_max_connections() -> int:
    """One socket per request in flight, within the process's open-file limit."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 100_000
    return max(64, soft - FD_RESERVE)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; parses one response at a time into ``Response``."""

    __slots__ = (
        "transport",
        "waiter",
        "buffer",
        "head",
        "status",
        "headers",
        "length",
        "chunked",
        "keep_alive",
        "closed",
        "idle_since",
        "key",
        "stream",
    )

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Response] | None = None
        self.stream: StreamResponse | None = None  # while a stream reads this connection
        self.closed = False
        self.idle_since = 0.0
        self._reset()

    def _reset(self) -> None:
        self.buffer = bytearray()
        self.head = False
        self.status = 0
        self.headers: dict[str, str] = {}
        self.length = -1
        self.chunked = False
        self.keep_alive = True

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.stream is not None:
            self.stream.lost(exc)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            if self.head and self.length < 0 and not self.chunked:
                waiter.set_result(self._response(bytes(self.buffer)))  # body ends with the stream
            else:
                reason = f": {exc}" if exc else ""
                waiter.set_exception(HttpError(f"connection closed before the response{reason}"))

    def send(self, data: bytes, waiter: asyncio.Future[Response]) -> None:
        assert self.transport is not None
        self._reset()
        self.waiter = waiter
        self.transport.write(data)

    def data_received(self, data: bytes) -> None:
        waiter = self.waiter
        if waiter is None or waiter.done():
            if self.stream is not None:  # a stream reads it (HttpPool.stream)
                self.stream.feed(data)
                return
            self._close()  # bytes nobody asked for: this connection cannot be trusted again
            return
        self.buffer += data
        try:
            if not self.head and not self._parse_head():
                return
            body = self._body()
        except (ValueError, IndexError) as exc:
            self._close()
            waiter.set_exception(HttpError(f"unreadable HTTP response: {exc}"))
            return
        if body is not None:
            self.waiter = None
            waiter.set_result(self._response(body))

    def _parse_head(self) -> bool:
        end = self.buffer.find(b"\r\n\r\n")
        if end < 0:
            if len(self.buffer) > _MAX_HEAD:
                raise ValueError("response head over 64 KiB")
            return False
        lines = bytes(self.buffer[:end]).decode("latin-1").split("\r\n")
        del self.buffer[: end + 4]
        version, status = lines[0].split(" ", 2)[:2]
        self.status = int(status)
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        self.headers = headers
        connection = headers.get("connection", "").lower()
        self.keep_alive = "close" not in connection and (
            version == "HTTP/1.1" or "keep-alive" in connection
        )
        if "chunked" in headers.get("transfer-encoding", "").lower():
            self.chunked = True
        elif "content-length" in headers:
            self.length = int(headers["content-length"])
        elif self.status in (204, 304) or 100 <= self.status < 200:
            self.length = 0
        else:
            self.keep_alive = False  # the body runs until the server closes
        self.head = True
        return True

    def _body(self) -> bytes | None:
        if self.length >= 0:
            if len(self.buffer) < self.length:
                return None
            body = bytes(self.buffer[: self.length])
            if len(self.buffer) > self.length:
                self.keep_alive = False  # more than was announced: do not reuse
            return body
        if self.chunked:
            return self._chunks()
        return None  # until the connection closes

    def _chunks(self) -> bytes | None:
        body = bytearray()
        at = 0
        buffer = self.buffer
        while True:
            line_end = buffer.find(b"\r\n", at)
            if line_end < 0:
                return None
            size = int(bytes(buffer[at:line_end]).split(b";", 1)[0], 16)
            start = line_end + 2
            if size == 0:
                trailer_end = buffer.find(b"\r\n\r\n", line_end)
                if trailer_end < 0 and buffer[start : start + 2] != b"\r\n":
                    return None
                return bytes(body)
            if len(buffer) < start + size + 2:
                return None
            body += buffer[start : start + size]
            at = start + size + 2

    def _response(self, body: bytes) -> Response:
        return Response(self.status, body, self.headers)

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    def abort(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.abort()

    def cut(self, why: str) -> None:
        """End the request (or stream) waiting here at once (``HttpError``) and drop the
        connection."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(HttpError(why))
        if self.stream is not None:
            self.stream.fail(HttpError(why))
        self.abort()


class SseParser:
    """Server-sent events (the WHATWG format) from bytes as they arrive: ``feed`` returns the
    ``data`` of each event its bytes complete (several ``data:`` lines joined by a newline).
    Lines end with ``\n`` or ``\r\n`` (not a lone ``\r``, which no engine writes); a blank line
    ends an event; comment lines (``:``) and the other fields (``event``, ``id``, ``retry``)
    are skipped; an event without data is none; a last event without its blank line is lost,
    as the format says."""

    __slots__ = ("_buffer", "_data")

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._data: list[bytes] | None = None

    def feed(self, data: bytes) -> list[bytes]:
        buffer = self._buffer
        buffer += data
        events: list[bytes] = []
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end < 0:
                break
            line = bytes(buffer[start : end - 1 if end > start and buffer[end - 1] == 13 else end])
            start = end + 1
            if not line:
                if self._data is not None:
                    events.append(b"\n".join(self._data))
                    self._data = None
                continue
            if line[0] == 58:  # ":" a comment
                continue
            name, colon, value = line.partition(b":")
            if name != b"data":
                continue
            if colon and value[:1] == b" ":
                value = value[1:]
            if self._data is None:
                self._data = [value]
            else:
                self._data.append(value)
        del buffer[:start]
        return events


# How a streamed body ends, and where its chunked decoding stands.
_UNTIL_CLOSE, _LENGTH, _CHUNKED = range(3)
_CHUNK_SIZE, _CHUNK_DATA, _CHUNK_END, _TRAILER = range(4)


class StreamResponse:
    """A response read as it arrives (``HttpPool.stream``): ``status`` and ``headers`` once its
    head is in, then the body as ``read()`` pieces (b"" at its end), ``body()`` (the rest,
    whole) or ``events()`` (its server-sent events' data). A connection that fails raises
    ``HttpError`` (``TimeoutError`` past the pool's timeout) from the read that meets it, after
    the bytes that came before. ``complete``: the whole body has arrived."""

    def __init__(self, conn: _Connection, loop: asyncio.AbstractEventLoop) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.complete = False
        self._conn = conn
        self._loop = loop
        self._head: asyncio.Future[None] = loop.create_future()
        self._pieces: list[bytes] = []
        self._pending = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._error: BaseException | None = None
        self._framing = _UNTIL_CLOSE
        self._left = 0  # of the content-length, or of the chunk being read
        self._raw = bytearray()  # chunked bytes not decoded yet
        self._chunk = _CHUNK_SIZE

    async def read(self) -> bytes:
        """The body's bytes that arrived since the last read (waiting for some), b"" at its end."""
        while True:
            if self._pieces:
                pieces = self._pieces
                data = pieces[0] if len(pieces) == 1 else b"".join(pieces)
                pieces.clear()
                self._pending = 0
                self._resume()
                return data
            if self._error is not None:
                raise self._error
            if self.complete:
                return b""
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def body(self) -> bytes:
        """The rest of the body, whole."""
        parts = []
        while data := await self.read():
            parts.append(data)
        return b"".join(parts)

    async def events(self) -> AsyncIterator[bytes]:
        """The ``data`` of each server-sent event of the body (``SseParser``), as it arrives."""
        parser = SseParser()
        while data := await self.read():
            for event in parser.feed(data):
                yield event

    # ---- the connection's side ---------------------------------------------------------
    def feed(self, data: bytes) -> None:
        if self._error is not None:
            return
        conn = self._conn
        if self.complete:
            conn.keep_alive = False  # bytes past the body: the connection cannot be reused
            return
        try:
            if not self._head.done():
                conn.buffer += data
                if not conn._parse_head():
                    return
                self._start_body()
                data = bytes(conn.buffer)
                conn.buffer.clear()
            if self._framing == _CHUNKED:
                self._raw += data
                self._dechunk()
            elif self._framing == _LENGTH:
                if len(data) > self._left:
                    conn.keep_alive = False  # more than was announced: do not reuse
                    data = data[: self._left]
                self._left -= len(data)
                self._add(data)
                self.complete = self._left == 0
            else:
                self._add(data)
        except (ValueError, IndexError) as exc:
            self.fail(HttpError(f"unreadable HTTP response: {exc}"))
            conn.abort()
            return
        self._wake()
        if self._pending > _STREAM_HIGH_WATER and not self._paused and conn.transport:
            self._paused = True
            conn.transport.pause_reading()

    def _start_body(self) -> None:
        conn = self._conn
        self.status, self.headers = conn.status, conn.headers
        if conn.chunked:
            self._framing = _CHUNKED
        elif conn.length >= 0:
            self._framing, self._left = _LENGTH, conn.length
            self.complete = conn.length == 0
        self._head.set_result(None)

    def _add(self, data: bytes) -> None:
        if data:
            self._pieces.append(data)
            self._pending += len(data)

    def _dechunk(self) -> None:
        raw = self._raw
        at = 0
        while not self.complete:
            if self._chunk == _CHUNK_DATA:
                take = min(self._left, len(raw) - at)
                if take == 0:
                    break
                self._add(bytes(raw[at : at + take]))
                at += take
                self._left -= take
                if self._left == 0:
                    self._chunk = _CHUNK_END
                continue
            end = raw.find(b"\r\n", at)
            if self._chunk == _CHUNK_END:
                if len(raw) - at < 2:
                    break
                if raw[at : at + 2] != b"\r\n":
                    raise ValueError("a chunk runs past its announced size")
                at += 2
                self._chunk = _CHUNK_SIZE
            elif end < 0:
                if len(raw) - at > _MAX_HEAD:
                    raise ValueError("a chunk-size line or trailer over 64 KiB")
                break
            elif self._chunk == _CHUNK_SIZE:
                size = int(bytes(raw[at:end]).split(b";", 1)[0], 16)
                at = end + 2
                self._chunk, self._left = (_CHUNK_DATA, size) if size else (_TRAILER, 0)
            else:  # trailer lines, up to an empty one
                self.complete = end == at
                at = end + 2
        if self.complete and at < len(raw):
            self._conn.keep_alive = False
        del raw[:at]

    def lost(self, exc: Exception | None) -> None:
        """The connection closed: the end of a body that runs until then, else a failure."""
        if self.complete or self._error is not None:
            return
        if self._head.done() and self._framing == _UNTIL_CLOSE:
            self.complete = True
            self._wake()
            return
        reason = f": {exc}" if exc else ""
        self.fail(HttpError(f"connection closed before the whole response{reason}"))

    def fail(self, error: BaseException) -> None:
        if self._error is not None:
            return
        self._error = error
        if not self._head.done():
            self._head.set_exception(error)
        self._wake()

    def expire(self) -> None:
        if not self.complete:
            self.fail(TimeoutError("no whole HTTP response within the timeout"))
            self._conn.abort()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _resume(self) -> None:
        if self._paused:
            self._paused = False
            if self._conn.transport is not None:
                self._conn.transport.resume_reading()

    def __repr__(self) -> str:
        state = "complete" if self.complete else "failed" if self._error else "reading"
        return f"<StreamResponse {self.status} {state}>"


class HttpPool:
    """Keep-alive connections to any number of hosts, ``max_connections`` open at most."""

    def __init__(
        self,
        *,
        timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        max_connections: int | None = None,
        keepalive_s: float = 4.0,
    ) -> None:
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        self.max_connections = max_connections or default_max_connections()
        self.keepalive_s = keepalive_s
        self._idle: dict[tuple[str, str, int], collections.deque[_Connection]] = {}
        self._open = 0
        self._slots: collections.deque[asyncio.Future[None]] = collections.deque()
        self._targets: dict[str, tuple[tuple[str, str, int], str, str]] = {}
        self._busy: dict[tuple[str, str, int], set[_Connection]] = {}
        self._ssl: ssl.SSLContext | None = None
        self._closed = False

    @property
    def open_connections(self) -> int:
        return self._open

    @property
    def closed(self) -> bool:
        return self._closed

    async def request(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        *,
        content_type: str = "application/json",
        timeout_s: float | None = None,
    ) -> Response:
        """Send one request and read its whole response; ``HttpError``/``TimeoutError`` when
        the connection fails first."""
        key, head = self._head(method, url, len(body), content_type, "application/json")
        loop = asyncio.get_running_loop()
        conn = await self._acquire(key, loop)
        waiter: asyncio.Future[Response] = loop.create_future()
        timer = loop.call_later(
            self.timeout_s if timeout_s is None else timeout_s, self._expire, conn, waiter
        )
        busy = self._busy.get(key)
        if busy is None:
            busy = self._busy[key] = set()
        busy.add(conn)
        try:
            conn.send(head + body if body else head, waiter)
            response = await waiter
        except BaseException:
            conn.abort()  # a cancelled or failed request leaves the connection in an unknown state
            self._release(conn, reuse=False)
            raise
        finally:
            timer.cancel()
            busy.discard(conn)
        self._release(conn, reuse=conn.keep_alive and not conn.closed)
        return response

    @contextlib.asynccontextmanager
    async def stream(
        self,
        method: str,
        url: str,
        body: bytes = b"",
        *,
        content_type: str = "application/json",
        accept: str = "text/event-stream",
        timeout_s: float | None = None,
    ) -> AsyncIterator[StreamResponse]:
        """``async with pool.stream("POST", url, body) as response:`` sends one request and
        enters once the response's head is in (``HttpError``/``TimeoutError`` when the
        connection fails first); the body is read from ``response`` as it arrives
        (``StreamResponse``). ``timeout_s`` (the pool's by default) bounds the whole exchange,
        the body's last byte included. Leaving before the whole body has arrived drops the
        connection; after, it is reused under the keep-alive rules of ``request``."""
        key, head = self._head(method, url, len(body), content_type, accept)
        loop = asyncio.get_running_loop()
        conn = await self._acquire(key, loop)
        response = StreamResponse(conn, loop)
        conn._reset()
        conn.waiter = None
        conn.stream = response
        timer = loop.call_later(self.timeout_s if timeout_s is None else timeout_s, response.expire)
        busy = self._busy.get(key)
        if busy is None:
            busy = self._busy[key] = set()
        busy.add(conn)
        reuse = False
        try:
            assert conn.transport is not None
            conn.transport.write(head + body)
            await response._head
            yield response
            reuse = response.complete and conn.keep_alive and not conn.closed
        finally:
            timer.cancel()
            busy.discard(conn)
            conn.stream = None
            response._resume()
            self._release(conn, reuse=reuse)

    def _head(
        self, method: str, url: str, length: int, content_type: str, accept: str
    ) -> tuple[tuple[str, str, int], bytes]:
        """The connection key of ``url`` and the request's head, the current span's
        ``traceparent`` in it."""
        if self._closed:
            raise HttpError("the HTTP client is closed")
        key, path, host = self._target(url)
        traceparent = current_traceparent()
        trace_line = f"traceparent: {traceparent}\r\n" if traceparent else ""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {length}\r\n"
            f"Accept: {accept}\r\n{trace_line}\r\n"
        ).encode("latin-1")
        return key, head

    def cut(self, url: str) -> int:
        """End every request (or stream) in flight to ``url``'s host at once, each raising
        ``HttpError`` where it waits (a server found dead by its health probe: consumers/fleet.py); returns
        how many there were."""
        key = self._target(url)[0]
        busy = list(self._busy.get(key, ()))
        for conn in busy:
            conn.cut(f"cut off: {url} was found dead")
        return len(busy)

    def in_flight(self, url: str) -> int:
        """Requests waiting for an answer from ``url``'s host."""
        return len(self._busy.get(self._target(url)[0], ()))

    def _target(self, url: str) -> tuple[tuple[str, str, int], str, str]:
        cached = self._targets.get(url)
        if cached is not None:
            return cached
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise HttpError(f"not an http(s) URL: {url!r}")
        port = parts.port or (443 if parts.scheme == "https" else 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        target = ((parts.scheme, parts.hostname, port), path, parts.netloc.rsplit("@", 1)[-1])
        if len(self._targets) < 1024:  # a fleet's few URLs: never grows with the requests
            self._targets[url] = target
        return target

    @staticmethod
    def _expire(conn: _Connection, waiter: asyncio.Future[Response]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError("no whole HTTP response within the timeout"))
        conn.abort()

    async def _acquire(
        self, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop
    ) -> _Connection:
        while True:
            conn = self._take_idle(key)
            if conn is not None:
                return conn
            if self._open < self.max_connections or self._evict_idle():
                break
            slot: asyncio.Future[None] = loop.create_future()
            self._slots.append(slot)
            try:
                await slot
            except BaseException:
                if slot.done() and not slot.cancelled():
                    self._wake()  # pass the turn on: it was handed to us as we gave up
                raise
        self._open += 1
        try:
            return await self._connect(key, loop)
        except BaseException:
            self._forget()
            raise

    def _take_idle(self, key: tuple[str, str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            conn = idle.pop()  # the most recently used: the least likely to have timed out
            if not conn.closed and now - conn.idle_since < self.keepalive_s:
                return conn
            conn.abort()
            self._open -= 1
        return None

    def _evict_idle(self) -> bool:
        """Close the longest-idle connection to any host, making room for a new one."""
        oldest: collections.deque[_Connection] | None = None
        for idle in self._idle.values():
            if idle and (oldest is None or idle[0].idle_since < oldest[0].idle_since):
                oldest = idle
        if oldest is None:
            return False
        oldest.popleft().abort()
        self._open -= 1
        return True

    async def _connect(
        self, key: tuple[str, str, int], loop: asyncio.AbstractEventLoop
    ) -> _Connection:
        scheme, hostname, port = key
        context = None
        if scheme == "https":
            if self._ssl is None:
                self._ssl = ssl.create_default_context()
            context = self._ssl
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(key), hostname, port, ssl=context
                )
        except TimeoutError:
            raise HttpError(
                f"could not connect to {hostname}:{port} within {self.connect_timeout_s:g}s"
            ) from None
        except OSError as exc:
            raise HttpError(f"could not connect to {hostname}:{port}: {exc}") from exc
        return conn

    def _release(self, conn: _Connection, *, reuse: bool) -> None:
        if reuse and not self._closed:
            conn.idle_since = time.monotonic()
            self._idle.setdefault(conn.key, collections.deque()).append(conn)
            self._wake()
            return
        if not conn.closed:
            conn.abort()
        self._forget()

    def _forget(self) -> None:
        """One connection fewer: a request waiting for room may open one."""
        self._open -= 1
        self._wake()

    def _wake(self) -> None:
        while self._slots:
            slot = self._slots.popleft()
            if not slot.done():
                slot.set_result(None)
                return

    async def close(self) -> None:
        self._closed = True
        for idle in self._idle.values():
            for conn in idle:
                conn.abort()
                self._open -= 1
        self._idle.clear()
        for slot in self._slots:
            if not slot.done():
                slot.set_exception(HttpError("the HTTP client is closed"))
        self._slots.clear()

    def __repr__(self) -> str:
        idle = sum(len(d) for d in self._idle.values())
        return f"<HttpPool open={self._open} idle={idle} max={self.max_connections}>"
