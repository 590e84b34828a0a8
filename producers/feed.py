"""TrajectoryFeed: one run's new trajectories, delivered to whoever is waiting for their jobs.

A training loop submits a batch every step into the same run, so reading the run from its
start at every step would replay all earlier steps. The feed instead opens one ephemeral
consumer on ``<prefix>.trajectories.<run>.>`` when it starts, delivering only what is stored
from then on, and keeps it for its whole life (re-created from the last sequence seen if the
broker loses it). Jobs whose trajectories were stored before the feed started (a batch
submitted again after a restart) are looked up one by one with ``lookup``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Collection, Iterable

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from agentarium.broker import Topology, cancel_and_wait
from agentarium.schemas import Job, Trajectory

from .reader import TrajectoryReader

log = structlog.get_logger("agentarium.feed")

FETCH = 256
FETCH_TIMEOUT_S = 1.0
INACTIVE_S = 120.0


class TrajectoryFeed:
    """``expect(job_ids)`` then ``await wait()``; ``results`` holds what arrived, by job id."""

    def __init__(self, js: JetStreamContext, topology: Topology, run: str) -> None:
        self.js = js
        self.topology = topology
        self.run = run
        self.results: dict[str, Trajectory] = {}
        self._reader = TrajectoryReader(js, topology)  # its decode and its look-ups
        self._wanted: set[str] = set()
        self._on_result: Callable[[Trajectory], None] | None = None
        self._changed = asyncio.Event()
        self._last_seq = 0
        self._sub: JetStreamContext.PullSubscription | None = None
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        info = await self.js.stream_info(self.topology.trajectories_stream)
        self._last_seq = info.state.last_seq
        await self._subscribe()
        self._task = asyncio.create_task(self._pump(), name=f"feed-{self.run}")

    async def _subscribe(self) -> None:
        config = ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self._last_seq + 1,
            mem_storage=True,
            inactive_threshold=INACTIVE_S,
            description=f"agentarium orchestrator feed for run {self.run}",
        )
        self._sub = await self.js.pull_subscribe(
            self.topology.trajectories_filter(self.run, "*"),
            durable=None,
            stream=self.topology.trajectories_stream,
            config=config,
        )

    async def close(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])  # a fetch may swallow one cancel (broker/aio.py)
            self._task = None
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
            self._sub = None

    # ---- what the caller waits for ---------------------------------------------------------
    def expect(
        self, job_ids: Iterable[str], on_result: Callable[[Trajectory], None] | None = None
    ) -> None:
        """Wait for these jobs from now on; results of earlier ones are forgotten."""
        self._wanted = set(job_ids)
        self.results = {}
        self._on_result = on_result
        self._changed.set()

    def clear(self) -> None:
        self.expect(())

    @property
    def skipped(self) -> int:
        """Undecodable messages seen so far."""
        return self._reader.skipped

    @property
    def missing(self) -> int:
        return len(self._wanted) - len(self.results)

    def _accept(self, trajectory: Trajectory) -> None:
        job_id = trajectory.job_id
        if job_id in self._wanted and job_id not in self.results:
            self.results[job_id] = trajectory
            if self._on_result is not None:
                try:
                    self._on_result(trajectory)
                except Exception:  # a progress callback must never stop the feed
                    log.exception("on_result callback failed")
            self._changed.set()

    async def lookup(self, jobs: Collection[Job]) -> int:
        """Direct look-ups for jobs stored before the feed saw them; returns how many were found."""
        found = 0
        for job in jobs:
            if job.job_id in self.results:
                continue
            trajectory = await self._reader.get(job.run, job.agent, job.job_id)
            if trajectory is not None:
                self._accept(trajectory)
                found += 1
        return found

    async def wait(self, timeout: float | None = None) -> dict[str, Trajectory]:
        """Until every expected job has a trajectory; TimeoutError says how many are missing."""
        try:
            async with asyncio.timeout(timeout):
                while self.missing > 0:
                    self._changed.clear()
                    if self._task is not None and self._task.done():
                        self._task.result()  # the pump died: raise its error
                    await self._changed.wait()
        except TimeoutError:
            raise TimeoutError(
                f"{self.missing} of {len(self._wanted)} trajectories of run {self.run!r} still "
                f"missing after {timeout}s: are consumers running for the batch's agents? "
                "(`agentarium broker status` shows waiting and in-flight jobs)"
            ) from None
        return dict(self.results)

    # ---- the pump --------------------------------------------------------------------------
    async def _pump(self) -> None:
        failures = 0
        while True:
            # start() subscribes before it starts the pump; close() stops the pump first.
            assert self._sub is not None, "the pump runs only while subscribed"
            try:
                msgs = await self._sub.fetch(FETCH, timeout=FETCH_TIMEOUT_S)
                failures = 0
            except TimeoutError:
                continue
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                failures += 1
                log.warning(
                    "trajectory feed fetch failed; re-subscribing",
                    error=str(exc) or type(exc).__name__,
                )
                await asyncio.sleep(min(5.0, 0.2 * 2**failures))
                with contextlib.suppress(Exception):
                    await self._sub.unsubscribe()
                with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, OSError):
                    await self._subscribe()
                continue
            for msg in msgs:
                with contextlib.suppress(Exception):
                    self._last_seq = msg.metadata.sequence.stream
                trajectory = self._reader.decode(msg.data, msg.headers, msg.subject)
                if trajectory is not None:
                    self._accept(trajectory)
