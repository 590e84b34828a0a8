"""JobPuller: keeps pull requests outstanding on the agent's durable consumer, so every free
slot of the worker has a job on its way, and hands each job over as it arrives.

nats-py's ``PullSubscription.fetch`` returns a batch at a time and costs, per message, a
task, a ``wait_for`` timer and a uuid (``Subscription.next_msg``); with a no-wait probe before
each lingering request it also costs a round trip per batch. Here one subscription with a
callback receives every job: a pull request (``$JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>``,
``{"batch", "expires"}``) names a reply subject under our inbox, JetStream delivers the jobs
there and, when a request expires unfilled, answers on the same subject with status 408 and
the count it did not deliver (409 when the server dropped it). A job message carries its
stream subject, not the request's, so jobs are counted against the oldest request (the server
fills waiting requests in order); a request that ends by a status is forgotten with what it
still owed, and one whose status never comes (a reconnect) is forgotten once it is past its
expiry. Unsubscribing drops the outstanding requests on the server (it checks interest).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Callable
from dataclasses import dataclass

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

log = structlog.get_logger("agentarium.consumers")

MAX_REQUESTS = 4  # pull requests outstanding at once
EXPIRY_GRACE_S = 2.0  # past its expiry plus this, a request whose status never came is dropped
START_CHUNK = 32  # jobs started between two turns of the event loop


@dataclass(eq=False)
class _Request:
    token: str
    remaining: int
    expires_at: float


class JobPuller:
    """Pulls for one durable consumer; ``on_job(msg)`` is called for each job, in order."""

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        durable: str,
        *,
        on_job: Callable[[Msg], None],
        capacity: int,
        max_batch: int = 256,
        expires_s: float = 1.0,
    ) -> None:
        self.js = js
        self.nc = js._nc
        prefix = getattr(js, "_prefix", "$JS.API")
        self.subject = f"{prefix}.CONSUMER.MSG.NEXT.{stream}.{durable}"
        self.on_job = on_job
        self.max_batch = max(1, max_batch)
        self.expires_s = expires_s
        # Ask again once this many slots are free: fewer, larger requests at high concurrency.
        self.threshold = max(1, min(self.max_batch, capacity) // 4)
        self.received = 0
        self._started = 0
        self.last_job_at = time.monotonic()
        self._requests: collections.deque[_Request] = collections.deque()
        self._by_token: dict[str, _Request] = {}
        self._sent = 0
        self._inbox = ""
        self._sub: Subscription | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._woken = False  # a wake() while nobody waited: the next wait() returns at once

    @property
    def outstanding(self) -> int:
        """Jobs asked for and not delivered yet."""
        return sum(r.remaining for r in self._requests)

    async def start(self) -> None:
        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox + ".*", cb=self._on_msg)

    async def close(self) -> None:
        """Unsubscribe: the server drops what is still outstanding."""
        sub, self._sub = self._sub, None
        self._requests.clear()
        self._by_token.clear()
        if sub is not None:
            await sub.unsubscribe()

    async def top_up(self, free: int) -> None:
        """Ask for jobs for ``free`` slots, minus those already asked for, in requests of at
        most ``max_batch``, once at least ``threshold`` (or every free slot) can be asked for."""
        self._forget_lost()
        want = free - self.outstanding
        while want >= min(self.threshold, free) and want > 0 and len(self._requests) < MAX_REQUESTS:
            batch = min(want, self.max_batch)
            await self._request(batch)
            want -= batch

    async def _request(self, batch: int) -> None:
        self._sent += 1
        token = str(self._sent)
        request = _Request(token, batch, time.monotonic() + self.expires_s)
        self._requests.append(request)
        self._by_token[token] = request
        body = {"batch": batch, "expires": int(self.expires_s * 1e9)}
        try:
            await self.nc.publish(
                self.subject, json.dumps(body).encode(), reply=f"{self._inbox}.{token}"
            )
        except BaseException:
            self._drop(request)
            raise

    async def _on_msg(self, msg: Msg) -> None:
        headers = msg.headers
        status = headers.get("Status") if headers else None
        if status is None:  # a job
            self.received += 1
            self.last_job_at = time.monotonic()
            if self._requests:
                oldest = self._requests[0]
                oldest.remaining -= 1
                if oldest.remaining <= 0:
                    self._drop(oldest)
            self.on_job(msg)
            self._started += 1
            if self._started % START_CHUNK == 0:
                # nats-py hands over a whole read's messages in one turn of the loop: let the
                # jobs started so far take their first step (and timers run) between chunks.
                await asyncio.sleep(0)
            return
        if status == "100":  # an idle heartbeat (never asked for)
            return
        request = self._by_token.get(msg.subject.rsplit(".", 1)[-1])
        if request is not None:
            self._drop(request)
        if status not in ("404", "408"):  # 409: a leader change, max waiting, deleted consumer...
            log.warning(
                "pull request ended by the server",
                status=status,
                description=headers.get("Description", "") if headers else "",
            )

    def _drop(self, request: _Request) -> None:
        if self._by_token.pop(request.token, None) is not None:
            self._requests.remove(request)
            self.wake()  # a request ended: room to ask again

    def _forget_lost(self) -> None:
        now = time.monotonic()
        for request in [r for r in self._requests if now > r.expires_at + EXPIRY_GRACE_S]:
            self._drop(request)

    def freed(self, free: int) -> None:
        """A slot was freed (``free`` now): wake the pull loop when that is worth a request."""
        if free - self.outstanding >= min(self.threshold, free):
            self.wake()

    def wake(self) -> None:
        waiter = self._waiter
        if waiter is None:
            self._woken = True
        elif not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> None:
        """Until ``wake()`` (a request ended, slots were freed, the worker stops) or ``timeout``."""
        if self._woken:
            self._woken = False
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(timeout, self._expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None

    @staticmethod
    def _expire(waiter: asyncio.Future[None]) -> None:
        if not waiter.done():
            waiter.set_result(None)

    def __repr__(self) -> str:
        return (
            f"<JobPuller {self.subject} requests={len(self._requests)} "
            f"outstanding={self.outstanding} received={self.received}>"
        )
