"""broker.cancel_and_wait ends a task that swallowed a cancellation, as nats-py's fetch can
on Python 3.11 (asyncio.wait_for returning a result that raced the cancel, CPython gh-86296)."""

from __future__ import annotations

import asyncio

from broker import cancel_and_wait


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
