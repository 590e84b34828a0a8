"""broker.cancel_and_wait ends a task that swallowed a cancellation, as nats-py's fetch can
on Python 3.11 (asyncio.wait_for returning a result that raced the cancel, CPython gh-86296);
broker.round_trip's PONG comes after what the client sent before it, which nats-py's flush()
does not make sure of."""

from __future__ import annotations

import asyncio
import contextlib

import nats

from agentarium.broker import cancel_and_wait, round_trip


async def test_a_task_that_swallows_one_cancel_is_still_ended():
    swallowed = asyncio.Event()

    async def pull_loop() -> None:
        while True:
            try:
                await asyncio.sleep(3600)
            except asyncio.CancelledError:
                if not swallowed.is_set():  # the first cancel is lost, as in the race
                    swallowed.set()
                    asyncio.current_task().uncancel()
                    continue
                raise

    stubborn = asyncio.create_task(pull_loop())
    finished = asyncio.create_task(asyncio.sleep(0))
    await finished
    async with asyncio.timeout(10):
        await cancel_and_wait([stubborn, finished])
    assert swallowed.is_set()
    assert stubborn.cancelled()
    assert finished.done() and not finished.cancelled()  # a finished task is left alone


async def test_a_round_trip_is_answered_after_the_subscription_made_before_it(nats_server):
    """What the client writes to the server, recorded by a relay between them: the SUB made
    before the round trip precedes its PING on the wire, so the server has the subscription
    when the PONG comes back. (nats-py 2.16's flush() writes its PING before the buffered SUB:
    this test fails with ``nc.flush()`` in place of ``round_trip(nc)``.)"""
    sent = bytearray()

    async def pipe(src: asyncio.StreamReader, dst: asyncio.StreamWriter, record: bool) -> None:
        with contextlib.suppress(OSError):
            while data := await src.read(65536):
                if record:
                    sent.extend(data)
                dst.write(data)
                await dst.drain()
        dst.close()

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_r, upstream_w = await asyncio.open_connection(nats_server.host, nats_server.port)
        await asyncio.gather(pipe(reader, upstream_w, True), pipe(upstream_r, writer, False))

    relay_server = await asyncio.start_server(relay, "127.0.0.1", 0)
    port = relay_server.sockets[0].getsockname()[1]
    nc = await nats.connect(f"nats://127.0.0.1:{port}", allow_reconnect=False)
    try:
        await nc.subscribe("probe.subject")
        await round_trip(nc)
        wire = bytes(sent)
        assert b"SUB probe.subject" in wire
        assert wire.index(b"SUB probe.subject") < wire.rindex(b"PING\r\n")
    finally:
        await nc.close()
        relay_server.close()
