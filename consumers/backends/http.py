"""A small HTTP/1.1 client for the backends' JSON calls: pooled keep-alive connections, one
request at a time on each, bodies read whole.

Why not aiohttp's client, which the rest of the project uses: an LLM call of a one-token
rollout costs the consumer ~165 us of CPU in aiohttp's request machinery (tracing hooks,
cookie jar, multidicts, a stream reader per response), as much as everything else the
rollout does; this client does the few things a ``POST /generate`` needs in a fraction of
that (docs/benchmarks.md, "Where a rollout's time goes"). What it leaves out on purpose:
pipelining, redirects, cookies, proxies from the environment (aiohttp ignores those by
default too), compression (it never asks for it), streaming, HTTP/2.

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
import resource
import ssl
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import orjson

from agentarium.broker import current_traceparent

# Sockets kept free for everything else a consumer holds open (NATS, its proxy, files).
FD_RESERVE = 512
_MAX_HEAD = 64 * 1024


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
    )

    def __init__(self, key: tuple[str, str, int]) -> None:
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[Response] | None = None
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
        """End the request waiting here at once (``HttpError``) and drop the connection."""
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(HttpError(why))
        self.abort()


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
        if self._closed:
            raise HttpError("the HTTP client is closed")
        key, path, host = self._target(url)
        traceparent = current_traceparent()
        trace_line = f"traceparent: {traceparent}\r\n" if traceparent else ""
        head = (
            f"{method} {path} HTTP/1.1\r\nHost: {host}\r\n"
            f"Content-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
            f"Accept: application/json\r\n{trace_line}\r\n"
        ).encode("latin-1")
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

    def cut(self, url: str) -> int:
        """End every request in flight to ``url``'s host at once, each raising ``HttpError``
        where it waits (a server found dead by its health probe: consumers/fleet.py); returns
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
