"""Intake: the worker's pull loop and the deliveries it has in flight.

It keeps a job on its way for every free slot (consumers/worker/puller.py), starts a task per
delivery as it arrives (``DeliveryHandler.handle``), takes nothing new while an LLM fleet of
the agent is down within its outage limit (in-flight rollouts wait for the fleet, heartbeated,
on their current delivery), ends a burst once the agent's queue is empty, and drains: finish
in-flight rollouts within a grace period, release the rest.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from agentarium.broker import Backoff, Topology

from ..config import ConsumerSettings
from ..fleet import Fleet
from ..metrics import RolloutMetrics
from .counters import Counters
from .handler import DeliveryHandler
from .puller import JobPuller

log = structlog.get_logger("agentarium.consumers")

PULL_BACKOFF = Backoff(initial_s=0.2, max_s=5.0)  # after a pull request failed


async def sleep_or_stop(stopping: asyncio.Event, seconds: float) -> None:
    """Wait ``seconds``, or less once ``stopping`` is set."""
    try:
        await asyncio.wait_for(stopping.wait(), timeout=seconds)
    except TimeoutError:
        pass


class Intake:
    """Pulls one agent's jobs from its durable consumer and runs each as a task."""

    def __init__(
        self,
        js: JetStreamContext,
        topo: Topology,
        *,
        durable: str,
        config: ConsumerSettings,
        handler: DeliveryHandler,
        fleets: tuple[Fleet, ...],
        stopping: asyncio.Event,
        counters: Counters,
        metrics: RolloutMetrics,
    ) -> None:
        self.js = js
        self.topo = topo
        self.durable = durable
        self.config = config
        self.handler = handler
        self.fleets = fleets
        self.stopping = stopping  # set by Worker.stop(): fetch nothing more, then drain
        self.counters = counters
        self.metrics = metrics
        self.paused = False  # waiting for a fleet that is down
        self._puller: JobPuller | None = None
        self._inflight: dict[asyncio.Task, Msg] = {}
        self._running: set[int] = set()  # the stream sequences of the jobs in flight
        self._releasing: set[asyncio.Task] = set()  # jobs delivered as the worker stopped

    @property
    def bound(self) -> bool:
        return self._puller is not None

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def messages(self) -> list[Msg]:
        """The deliveries in flight (what the heartbeat keeps alive)."""
        return list(self._inflight.values())

    def wake(self) -> None:
        """Have the pull loop look again now (a stop, a fleet going down or coming back)."""
        if self._puller is not None:
            self._puller.wake()

    async def open(self) -> None:
        """Bind the pull subscription; transient broker errors are the caller's to retry."""
        cfg = self.config
        puller = JobPuller(
            self.js,
            self.topo.tasks_stream,
            self.durable,
            on_job=self._start,
            capacity=cfg.concurrency,
            max_batch=cfg.max_fetch,
            expires_s=cfg.fetch_timeout_s,
        )
        await puller.start()
        self._puller = puller

    async def run(self) -> None:
        """Keep a job on its way for every free slot until stopped (or, in burst mode, until
        the queue is empty); jobs start as they arrive, in ``_start``."""
        cfg = self.config
        puller = self._puller
        assert puller is not None, "open() binds the puller before the pull loop"
        errors_in_row = 0
        while not self.stopping.is_set():
            held = [fleet for fleet in self.fleets if fleet.holding]
            if held:  # the fleet is down: take nothing new until it answers (or the limit)
                if cfg.burst and not self._inflight and await self._queue_empty():
                    return  # a burst with nothing left to do has no reason to wait for it
                self.paused = True
                await puller.close()  # the server drops the requests outstanding
                await self._wait_for_fleets(held)
                await puller.start()
                self.paused = False
                continue
            try:
                await puller.top_up(cfg.concurrency - len(self._inflight))
                errors_in_row = 0
            except (nats.errors.Error, OSError) as exc:
                errors_in_row += 1
                log.warning("pull request failed; retrying", error=str(exc) or type(exc).__name__)
                await sleep_or_stop(self.stopping, PULL_BACKOFF.delay(errors_in_row))
                continue
            await puller.wait(cfg.fetch_timeout_s)
            if (
                cfg.burst
                and not self._inflight
                and time.monotonic() - puller.last_job_at >= cfg.fetch_timeout_s
                and await self._queue_empty()
            ):
                return
        await self.close()  # the server drops the requests still outstanding

    async def drain(self) -> None:
        """Let in-flight rollouts finish within the drain grace; release the rest."""
        if self._releasing:  # jobs that arrived as the worker stopped
            await asyncio.gather(*self._releasing, return_exceptions=True)
        if not self._inflight:
            return
        grace = self.config.drain_grace_s
        log.info("draining", in_flight=len(self._inflight), grace_s=grace)
        _, pending = await asyncio.wait(list(self._inflight), timeout=grace)
        for task in pending:
            task.cancel()  # the handler naks the message on cancellation
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            log.warning("drain grace over; released unfinished jobs", released=len(pending))

    async def close(self) -> None:
        """Unsubscribe (before any nc.drain(): a live subscription hangs it)."""
        puller, self._puller = self._puller, None
        if puller is not None:
            try:
                await puller.close()
            except Exception:  # noqa: BLE001 - stopping: the connection may be gone already
                pass

    def _start(self, msg: Msg) -> None:
        """Run one delivered job (the puller calls this for each)."""
        if self.stopping.is_set():  # delivered as the worker stopped: released as a drain does
            task = asyncio.create_task(self.handler.release(msg))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            return
        sequence = msg.metadata.sequence.stream
        if sequence in self._running:
            # Redelivered while its first delivery still runs here: the broker missed the
            # heartbeats (this process stalled past ack_wait). Running it again would race the
            # first run for the job's proxy route and count a failure that did not happen; the
            # first run acks the job (an ack names the stream sequence, whichever delivery).
            self.counters.redelivered_running += 1
            log.warning(
                "redelivered while it runs here; left to its first delivery",
                stream_seq=sequence,
                delivery=msg.metadata.num_delivered,
            )
            task = asyncio.create_task(_in_progress(msg))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            return
        self.counters.fetched += 1
        task = asyncio.create_task(self.handler.handle(msg))
        self._inflight[task] = msg
        self._running.add(sequence)
        self.metrics.in_flight.inc()
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._running.discard(self._inflight[task].metadata.sequence.stream)
        del self._inflight[task]
        self.metrics.in_flight.dec()
        if self._puller is not None:
            self._puller.freed(self.config.concurrency - len(self._inflight))

    async def _wait_for_fleets(self, fleets: list[Fleet]) -> None:
        waits: list[asyncio.Task] = [asyncio.create_task(self.stopping.wait())]
        waits += [asyncio.create_task(fleet.wait_serving()) for fleet in fleets]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()

    async def _queue_empty(self) -> bool:
        """Burst mode ends when nothing is pending or in flight anywhere for this agent."""
        if self._inflight:
            return False
        try:
            info = await self.js.consumer_info(self.topo.tasks_stream, self.durable)
        except (nats.errors.Error, nats.js.errors.Error):
            return False
        return not info.num_pending and not info.num_ack_pending


async def _in_progress(msg: Msg) -> None:
    """Restart the broker's redelivery timer on a job that runs under an earlier delivery."""
    try:
        await msg.in_progress()
    except Exception as exc:  # noqa: BLE001 - the running delivery's heartbeat does the same
        log.debug("in-progress on a redelivery failed", error=str(exc))
