"""RolloutClient: publish jobs and await each one's trajectory, for any number of callers at once.

An RL framework asks for rollouts from inside its own loop: TRL once per step with the whole
batch, verl once per sample from hundreds of concurrent agent-loop coroutines. Both need the
same thing, a job in and its trajectory out, so both use this one client. It owns a
``producers.RunSession`` (connection, provisioning, the ``TaskProducer`` and the run's
``TrajectoryFeed``) and keeps a future per job still awaited: the feed is told the whole pending
set each time it grows (``expect`` forgets what was delivered, which is what the futures
already hold) and resolves each future as its trajectory is stored.

A job whose trajectory does not arrive within its wait (no consumer runs the agent, or the
broker lost it) resolves to None: the caller decides what a missing rollout means, and it is
never a reward of 0.

It imports only ``schemas``, ``broker`` and ``producers``, so it runs in verl's virtualenv.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import structlog

from agentarium.broker import Limits, NatsSettings
from agentarium.inference import wait_served
from agentarium.producers import RunSession
from agentarium.schemas import Job, Trajectory

log = structlog.get_logger("agentarium.integrations")


class RolloutClient:
    """``await start()``, then ``await run(jobs, timeout)`` from any number of tasks;
    ``close()``. All calls on one event loop."""

    def __init__(
        self,
        settings: NatsSettings,
        run: str,
        *,
        limits: Limits | None = None,
        name: str = "agentarium-integration",
    ) -> None:
        self.session = RunSession(settings, run, limits=limits, name=name)
        self.run_id = run
        self._pending: dict[str, asyncio.Future[Trajectory]] = {}
        self.published = 0
        self.missing = 0

    def __repr__(self) -> str:
        return (
            f"<RolloutClient run={self.run_id!r} pending={len(self._pending)} "
            f"published={self.published} missing={self.missing}>"
        )

    async def start(self) -> RolloutClient:
        await self.session.start()
        return self

    @property
    def js(self):
        return self.session.js

    @property
    def topology(self):
        return self.session.topology

    def _deliver(self, trajectory: Trajectory) -> None:
        future = self._pending.pop(trajectory.job_id, None)
        if future is not None and not future.done():
            future.set_result(trajectory)

    def _expect_pending(self) -> None:
        feed = self.session.feed
        assert feed is not None, "start() first"
        feed.expect(self._pending, self._deliver)

    async def run(self, jobs: Sequence[Job], timeout: float) -> list[Trajectory | None]:
        """Publish ``jobs`` and return their trajectories in job order, None for each one not
        stored within ``timeout`` seconds."""
        assert self.session.producer is not None and self.session.feed is not None, "start() first"
        if not jobs:
            return []
        loop = asyncio.get_running_loop()
        futures = []
        for job in jobs:
            future = self._pending.get(job.job_id)
            if future is None:
                future = self._pending[job.job_id] = loop.create_future()
            futures.append(future)
        self._expect_pending()  # before publishing: nothing stored in between is missed
        try:
            published, duplicates = await self.session.producer.publish_jobs(jobs)
            self.published += published
            if duplicates:  # submitted before: some may be stored already
                await self.session.feed.lookup(jobs)
            await asyncio.wait(futures, timeout=timeout)
        finally:
            for job in jobs:  # nobody waits for them any more (done, timed out or cancelled)
                self._pending.pop(job.job_id, None)
            self._expect_pending()
        out: list[Trajectory | None] = []
        for future in futures:
            if future.done() and not future.cancelled():
                out.append(future.result())
            else:
                future.cancel()
                out.append(None)
        lost = sum(t is None for t in out)
        if lost:
            self.missing += lost
            log.warning(
                "rollouts missing: no trajectory stored in time (is a consumer running for "
                "the agent? `agentarium broker status` shows waiting and in-flight jobs)",
                run=self.run_id,
                agent=jobs[0].agent,
                missing=lost,
                of=len(jobs),
                timeout_s=timeout,
            )
        return out

    async def wait_served(self, version: int, timeout: float) -> bool:
        """True once every engine of the run serves ``version`` or newer (the engines KV the
        syncers, or a streaming publisher, write)."""
        return await wait_served(self.js, self.topology, self.run_id, version, timeout=timeout)

    async def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        await self.session.close()
