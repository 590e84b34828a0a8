"""The backends' HTTP/1.1 client (consumers/backends/http.py) against real sockets: servers
written here byte for byte, so every way a response can end is exercised."""

from __future__ import annotations

import asyncio

import pytest
from httplib import ok, read_request

from agentarium.broker import free_port
from agentarium.consumers.backends.http import HttpError, HttpPool


async def _echo_forever(reader, writer):
    while True:
        path, body = await read_request(reader)
        writer.write(ok(b'{"path": "%s", "body": %s}' % (path.encode(), body or b"null")))
        await writer.drain()


async def test_json_round_trips_reuse_one_connection(serve):
    url, stats = await serve(_echo_forever)
    pool = HttpPool()
    for i in range(3):
        response = await pool.request("POST", f"{url}/generate?x=1", b'{"n": %d}' % i)
        assert response.status == 200
        assert response.json() == {"path": "/generate?x=1", "body": {"n": i}}
    assert stats["connections"] == 1 and pool.open_connections == 1
    await pool.close()
    assert pool.open_connections == 0


async def test_chunked_body(serve):
    async def chunked(reader, writer):
        await read_request(reader)
        writer.write(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
            b'4\r\n{"a"\r\n6;ext=1\r\n: [1, \r\n3\r\n2]}\r\n0\r\n\r\n'
        )
        await writer.drain()
        await _echo_forever(reader, writer)

    url, stats = await serve(chunked)
    pool = HttpPool()
    assert (await pool.request("GET", f"{url}/x")).json() == {"a": [1, 2]}
    assert (await pool.request("GET", f"{url}/y")).json()["path"] == "/y"
    assert stats["connections"] == 1  # the chunked answer left the connection reusable
    await pool.close()


async def test_connection_close_and_body_until_eof(serve):
    async def closing(reader, writer):
        await read_request(reader)
        writer.write(b'HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\n{"busy": true}')
        await writer.drain()

    url, stats = await serve(closing)
    pool = HttpPool()
    for _ in range(2):
        response = await pool.request("POST", f"{url}/generate", b"{}")
        assert response.status == 503 and response.json() == {"busy": True}
        assert response.headers["connection"] == "close"
    assert stats["connections"] == 2 and pool.open_connections == 0
    await pool.close()


async def test_server_closing_an_idle_connection_is_not_an_error(serve):
    async def one_per_connection(reader, writer):
        await read_request(reader)
        writer.write(ok(b"{}"))
        await writer.drain()  # then closes, as a keep-alive timeout would

    url, stats = await serve(one_per_connection)
    pool = HttpPool()
    await pool.request("GET", f"{url}/a")
    while not all(c.closed for idle in pool._idle.values() for c in idle):
        await asyncio.sleep(0.01)  # until the server's close reaches the client: no event says so
    assert (await pool.request("GET", f"{url}/b")).status == 200
    assert stats["connections"] == 2
    await pool.close()


async def test_idle_connections_expire_before_the_server_closes_them(serve):
    url, stats = await serve(_echo_forever)
    pool = HttpPool(keepalive_s=0.0)
    await pool.request("GET", f"{url}/a")
    await pool.request("GET", f"{url}/b")
    assert stats["connections"] == 2 and pool.open_connections == 1
    await pool.close()


async def test_failures_raise_http_error_or_timeout(serve):
    pool = HttpPool(timeout_s=0.3)
    with pytest.raises(HttpError, match="could not connect"):
        await pool.request("GET", f"http://127.0.0.1:{free_port()}/x")

    async def half(reader, writer):
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{"cut')
        await writer.drain()

    url, _ = await serve(half)
    with pytest.raises(HttpError, match="closed before the response"):
        await pool.request("GET", f"{url}/x")

    async def silent(reader, writer):
        await read_request(reader)
        await asyncio.sleep(5)

    url, _ = await serve(silent)
    with pytest.raises(TimeoutError):
        await pool.request("GET", f"{url}/x")
    assert pool.open_connections == 0  # a timed-out connection is dropped, not reused

    async def garbage(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 abc\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(1)

    url, _ = await serve(garbage)
    with pytest.raises(HttpError, match="unreadable"):
        await pool.request("GET", f"{url}/x")
    await pool.close()
    with pytest.raises(HttpError, match="closed"):
        await pool.request("GET", f"{url}/x")


async def test_max_connections_queues_requests_and_cancellation_frees_slots(serve):
    gate = asyncio.Event()
    arrived = asyncio.Queue()

    async def gated(reader, writer):
        while True:
            path, _ = await read_request(reader)
            await arrived.put(path)
            await gate.wait()
            writer.write(ok(b"{}"))
            await writer.drain()

    url, stats = await serve(gated)
    pool = HttpPool(max_connections=2)
    requests = [asyncio.create_task(pool.request("GET", f"{url}/{i}")) for i in range(5)]
    await arrived.get()
    await arrived.get()
    assert pool.open_connections == 2 and arrived.empty()
    requests[0].cancel()  # its connection is dropped; a waiting request takes the room
    await arrived.get()
    assert pool.open_connections == 2
    gate.set()
    results = await asyncio.gather(*requests[1:])
    assert [r.status for r in results] == [200] * 4
    assert stats["connections"] == 3 and pool.open_connections <= 2
    await pool.close()


async def test_room_is_made_by_closing_an_idle_connection_to_another_host(serve):
    url_a, _ = await serve(_echo_forever)
    url_b, _ = await serve(_echo_forever)
    pool = HttpPool(max_connections=1)
    await pool.request("GET", f"{url_a}/a")
    assert (await pool.request("GET", f"{url_b}/b")).json()["path"] == "/b"
    assert pool.open_connections == 1
    await pool.close()
