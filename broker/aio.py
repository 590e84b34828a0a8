"""Two asyncio pitfalls under nats-py: stopping background tasks for sure
(``cancel_and_wait``), and a round trip that covers what was sent before it (``round_trip``).

On Python 3.11, ``asyncio.wait_for`` returns the inner result instead of raising when a
cancellation arrives in the same loop iteration as that result (CPython gh-86296, fixed in
3.12). nats-py's ``fetch`` waits for messages that way, so a task pulling in a loop while
messages stream in can swallow one ``cancel()`` and go on pulling, and whoever awaits it after
cancelling (a collector or feed being closed) waits forever. Cancelling until the task is done
ends it whatever the race.

nats-py's ``flush()`` (2.16) writes its PING straight to the socket, while SUB, UNSUB and PUB
wait in the client's buffer for its flusher task: the PING goes out first, so its PONG can come
back before the server has read them (nats-server's trace shows ``PING`` before the ``SUB`` just
made). Another connection's message sent after that flush can then find no subscription (a
reply to a new inbox dropped: the flaky late-start test of the env worker). ``round_trip``
hands the buffer to the socket first, then flushes.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from nats.aio.client import Client

RETRY_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel every task and return once all are done, cancelling again any that swallowed the
    cancellation; their results and exceptions are left alone."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RETRY_S)


async def round_trip(nc: Client, timeout_s: float = 10.0) -> None:
    """Return once the server has read every command this client sent before the call: the
    buffered commands are written (nats-py's forced flush of its buffer), then a PING, whose
    PONG comes back after them on the one connection. Raises TimeoutError after
    ``timeout_s``."""
    # nats-py has no public call that waits for its buffer to reach the socket; and its
    # _flush_pending swallows a CancelledError, so it runs as a task of its own, waited for
    # with a bound, rather than under asyncio.timeout (whose cancel it would eat).
    writing = asyncio.ensure_future(nc._flush_pending(force_flush=True))
    done, _ = await asyncio.wait({writing}, timeout=timeout_s)
    if not done:
        writing.cancel()
        raise TimeoutError(f"nats-py did not write its buffer within {timeout_s:g}s")
    writing.result()
    await nc.flush(timeout=max(1, int(timeout_s)))
