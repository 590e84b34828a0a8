"""Stopping background tasks for sure: ``cancel_and_wait``.

On Python 3.11, ``asyncio.wait_for`` returns the inner result instead of raising when a
cancellation arrives in the same loop iteration as that result (CPython gh-86296, fixed in
3.12). nats-py's ``fetch`` waits for messages that way, so a task pulling in a loop while
messages stream in can swallow one ``cancel()`` and go on pulling, and whoever awaits it after
cancelling (a collector or feed being closed) waits forever. Cancelling until the task is done
ends it whatever the race.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

RETRY_S = 0.1


async def cancel_and_wait(tasks: Iterable[asyncio.Task]) -> None:
    """Cancel every task and return once all are done, cancelling again any that swallowed the
    cancellation; their results and exceptions are left alone."""
    pending = {task for task in tasks if not task.done()}
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=RETRY_S)
