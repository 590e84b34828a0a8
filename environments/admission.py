"""Admission: a worker listens on its start subject only while it has room for a session.

NATS never re-routes a queue request a subscriber declines, so a full worker must not be
subscribed: it unsubscribes when full (what the server already routed here is still answered,
503 when it no longer fits) and subscribes again when a slot frees. A start finding no worker
with room gets no-responders and its client backs off. Whether there is room is the worker's
call (``has_room``); this module only follows it, in one loop woken by ``changed()``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from agentarium.broker import round_trip

from .metrics import EnvMetrics

log = structlog.get_logger("agentarium.environments")

RETRY_S = 0.5  # after a failed (un)subscribe, e.g. while a reconnect is under way


class Admission:
    """The start subscription (queue group ``queue`` on ``subject``), held while ``has_room()``."""

    def __init__(
        self,
        nc: Client,
        *,
        subject: str,
        queue: str,
        on_start: Callable[[Msg], Awaitable[None]],
        has_room: Callable[[], bool],
        linger_s: float,
        metrics: EnvMetrics,
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.nc = nc
        self.subject = subject
        self.queue = queue
        self.subscription: Subscription | None = None
        self._on_start = on_start
        self._has_room = has_room
        self._linger_s = linger_s
        self._metrics = metrics
        self._spawn = spawn
        self._interest = asyncio.Event()
        self._stopped = False

    @property
    def accepting(self) -> bool:
        """Subscribed to the start subject right now."""
        return self.subscription is not None

    def changed(self) -> None:
        """The room may have changed: reconsider the subscription (in ``run``)."""
        self._interest.set()

    async def subscribe(self) -> None:
        self.subscription = await self.nc.subscribe(
            self.subject, queue=self.queue, cb=self._on_start
        )
        self._metrics.accepting.inc()

    async def run(self) -> None:
        """Follow the room until ``stop()``; ends on the flag, not by cancellation (Python
        3.11's wait_for, inside nats-py's flush inside a subscription's drain, can swallow
        a cancel)."""
        while not self._stopped:
            await self._interest.wait()
            self._interest.clear()
            if self._stopped:
                return
            try:
                await self._follow_room()
            except Exception:  # noqa: BLE001 - e.g. a reconnect under way: try again shortly
                log.warning("could not change the start subscription; retrying", exc_info=True)
                await asyncio.sleep(RETRY_S)
                self._interest.set()

    def stop(self) -> None:
        """``run`` returns; call ``close()`` once it has."""
        self._stopped = True
        self._interest.set()

    async def close(self) -> None:
        if self.subscription is None:
            return
        sub, self.subscription = self.subscription, None
        self._metrics.accepting.dec()
        with contextlib.suppress(Exception):
            await sub.unsubscribe()

    async def _follow_room(self) -> None:
        want = self._has_room()
        if want and self.subscription is None:
            await self.subscribe()
        elif not want and self.subscription is not None:
            sub, self.subscription = self.subscription, None
            self._metrics.accepting.dec()
            self._spawn(self._linger(sub))  # first: drained in the end even if this fails
            await _unsubscribe_keeping_callback(self.nc, sub)

    async def _linger(self, sub: Subscription) -> None:
        """Answer what still comes on a start subscription after its UNSUB, then drop it."""
        try:
            await asyncio.sleep(self._linger_s)
        finally:
            with contextlib.suppress(Exception):
                await sub.drain()  # a late start being answered now finishes first


async def _unsubscribe_keeping_callback(nc: Client, sub: Subscription) -> None:
    """Send the UNSUB of ``sub`` and a round trip, as nats-py's drain does (but one whose PONG
    follows the UNSUB: broker.round_trip), while ``sub`` keeps its callback (``_linger`` drops
    it later): nats-server can deliver a start it routed here before the UNSUB after the
    worker's round trip (seen 60 ms late on a loaded machine, with nats-py's flush, whose PING
    overtook the UNSUB), and nats-py drops a message whose subscription is gone, so its client
    would wait for its request timeout (60 s) instead of an answer.

    The one use of nats-py's private API in the worker: nats-py has no public call that sends
    the UNSUB and keeps the subscription. tests/test_env_worker.py injects that race."""
    await nc._send_unsubscribe(sub._id)
    await round_trip(nc)
