"""The worker's background loops: the heartbeat and the registry entry.

Both are informational or protective, never essential: a lost heartbeat only risks a
redelivery (which the delivery rules handle), a lost registry update only a stale line in
``broker status``. Neither may stop the worker, nor keep it from stopping.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from agentarium.broker import Topology, publish_worker

log = structlog.get_logger("agentarium.consumers")

STOP_S = 5.0  # how long stopping waits for the loops
HEARTBEAT_CHUNK = 500  # heartbeats sent between two turns of the event loop


Pause = Callable[..., Awaitable[bool]]  # BackgroundLoops.pause


class BackgroundLoops:
    """Runs loops of the form ``async def loop(pause)`` until ``stop()``. ``pause(seconds,
    kick)`` waits between two turns and says whether the loop must end: the loops are
    cancelled too, but a cancellation can be lost inside nats-py's KV put (Python 3.11), and
    the flag ends them at their next turn."""

    def __init__(self) -> None:
        self._quit = asyncio.Event()
        self._tasks: list[asyncio.Task] = []

    def start(self, *loops: Callable[[Pause], Coroutine[Any, Any, None]]) -> None:
        self._tasks += [asyncio.create_task(loop(self.pause)) for loop in loops]

    async def pause(self, seconds: float, kick: asyncio.Event | None = None) -> bool:
        """Wait ``seconds`` (or until ``kick`` is set); True when the loops must end."""
        waits = [asyncio.create_task(self._quit.wait())]
        if kick is not None:
            waits.append(asyncio.create_task(kick.wait()))
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        return self._quit.is_set()

    async def stop(self) -> None:
        self._quit.set()
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        if not tasks:
            return
        _, stuck = await asyncio.wait(tasks, timeout=STOP_S)
        if stuck:  # never let a stuck informational loop keep the worker from stopping
            log.warning("background loop did not stop; left behind", tasks=len(stuck))


class Heartbeat:
    """``in_progress()`` on every in-flight job, so long rollouts are not redelivered."""

    def __init__(self, messages: Callable[[], list[Msg]], *, period_s: float) -> None:
        self.messages = messages
        self.period_s = period_s

    async def __call__(self, pause: Pause) -> None:
        while not await pause(self.period_s):
            for n, msg in enumerate(self.messages(), 1):
                try:
                    await msg.in_progress()
                except Exception as exc:  # a lost heartbeat only risks a redelivery
                    log.debug("heartbeat failed", error=str(exc))
                if n % HEARTBEAT_CHUNK == 0:  # tens of thousands in flight: let others run
                    await asyncio.sleep(0)


class RegistryEntry:
    """The worker's entry in the workers registry (what ``broker status`` shows), refreshed
    every ``interval_s`` and at once when ``kick`` is set (an LLM fleet went down or came
    back). ``status()`` is the worker's state now, its ``completed`` count included."""

    def __init__(
        self,
        js: JetStreamContext,
        topo: Topology,
        worker_id: str,
        status: Callable[[], dict[str, Any]],
        *,
        interval_s: float,
        kick: asyncio.Event,
    ) -> None:
        self.js = js
        self.topo = topo
        self.worker_id = worker_id
        self.status = status
        self.interval_s = interval_s
        self.kick = kick

    async def __call__(self, pause: Pause) -> None:
        started = time.time()
        last_time, last_done = started, 0
        while True:
            now = time.time()
            status = self.status()
            # rollouts/s over the last interval: what `broker status` sums per agent
            rate = (status["completed"] - last_done) / max(now - last_time, 1e-9)
            last_time, last_done = now, status["completed"]
            info = {
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "started_at": started,
                "rollouts_per_s": round(rate, 2),
                **status,
            }
            try:
                await publish_worker(self.js, self.topo, self.worker_id, info)
            except Exception as exc:  # registry is informational; never stop the worker for it
                log.debug("registry update failed", error=str(exc))
            if await pause(self.interval_s, self.kick):
                return
            self.kick.clear()
