"""The event loop of every Agentarium process: uvloop when it is installed, else asyncio's own.

A consumer spends a large part of each rollout in the loop itself (scheduling tasks, socket
callbacks); uvloop runs that part in C (docs/benchmarks.md, "Where a rollout's time goes").
``AGENTARIUM_EVENT_LOOP=asyncio`` turns it off, e.g. to compare, or to debug with asyncio's
pure-Python loop.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

ENV = "AGENTARIUM_EVENT_LOOP"


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    """What builds a new loop: ``uvloop.new_event_loop`` unless asyncio is asked for (``ENV``)
    or uvloop is missing."""
    choice = os.environ.get(ENV, "auto").strip().lower()
    if choice not in ("auto", "uvloop", "asyncio"):
        raise ValueError(f"{ENV}={choice!r}: use auto, uvloop or asyncio")
    if choice != "asyncio":
        try:
            import uvloop
        except ImportError:
            if choice == "uvloop":
                raise ValueError(
                    f"{ENV}=uvloop but uvloop is not installed: pip install uvloop"
                ) from None
        else:
            return uvloop.new_event_loop
    return asyncio.new_event_loop


def new_event_loop() -> asyncio.AbstractEventLoop:
    return loop_factory()()


def run_loop(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(main)`` on the chosen loop."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


async def watch_lag(observe: Callable[[float], None], *, every_s: float = 0.05) -> None:
    """Until cancelled: sleep ``every_s`` and ``observe`` how late the loop woke up (seconds).

    The event-loop lag: how long a callback that is due waits for the loop, which every
    socket read, timer and rollout of the process shares."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        observe(max(0.0, loop.time() - due))


def loop_name(loop: asyncio.AbstractEventLoop | None = None) -> str:
    """``uvloop`` or ``asyncio``: what a process logs about its loop."""
    loop = loop or asyncio.get_running_loop()
    return "uvloop" if type(loop).__module__.startswith("uvloop") else "asyncio"
