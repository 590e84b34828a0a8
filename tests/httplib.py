"""HTTP/1.1 servers written byte for byte, for the tests of the backends' HTTP client
(consumers/backends/http.py): the ``serve`` fixture starts one on loopback per handler (a
coroutine given the connection's reader and writer) and counts its connections;
``read_request`` reads a request's path and body, ``ok`` frames a 200 response around a JSON
body. conftest.py makes ``serve`` a fixture of every test module."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(reader: asyncio.StreamReader) -> tuple[str, bytes]:
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.decode().split("\r\n"):
        if line.lower().startswith("content-length:"):
            length = int(line.split(":", 1)[1])
    body = await reader.readexactly(length) if length else b""
    return head.decode().split(" ")[1], body


def ok(body: bytes, extra: str = "") -> bytes:
    return (
        f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{extra}\r\n"
    ).encode() + body


@pytest.fixture
async def serve():
    servers: list[asyncio.Server] = []

    async def start(handler: Handler) -> tuple[str, dict]:
        stats = {"connections": 0}

        async def on_connect(reader, writer):
            stats["connections"] += 1
            try:
                await handler(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        server = await asyncio.start_server(on_connect, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", stats

    yield start
    for server in servers:
        server.close()
