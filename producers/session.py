"""RunSession: the producer side of one run, set up in one place.

A connection, the broker provisioned for Agentarium, a ``TaskProducer`` to publish jobs and a
``TrajectoryFeed`` that delivers the trajectories of the jobs being waited for. The
orchestrator, ``eval run`` and the demo all start one; ``submit`` then ``wait`` is the
publish-and-collect cycle they share.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from agentarium.broker import START_PATIENCE_S, Limits, NatsSettings, Topology, ensure_provisioned
from agentarium.schemas import Job, Trajectory

from .feed import TrajectoryFeed
from .sdk import TaskProducer


class RunSession:
    """``await start()``, then ``submit(jobs)`` and ``wait()`` as often as needed; ``close()``."""

    def __init__(
        self,
        settings: NatsSettings,
        run: str,
        *,
        limits: Limits | None = None,
        name: str = "agentarium",
    ) -> None:
        self.settings = settings
        self.run = run
        self.limits = limits
        self.name = name
        self.topology = Topology(settings.prefix)
        self.nc: Any = None
        self.js: Any = None
        self.producer: TaskProducer | None = None
        self.feed: TrajectoryFeed | None = None

    def __repr__(self) -> str:
        missing = self.feed.missing if self.feed else 0
        return f"<RunSession run={self.run!r} missing={missing}>"

    async def start(self) -> RunSession:
        self.nc = await self.settings.connect(name=self.name)
        self.js = self.nc.jetstream()
        # A restarting broker or a leader election is waited out, as publishes wait it out.
        await ensure_provisioned(self.js, self.topology, self.limits, patience_s=START_PATIENCE_S)
        self.producer = TaskProducer(self.js, self.topology)
        self.feed = TrajectoryFeed(self.js, self.topology, self.run)
        # Before anything is read or published, so nothing stored in between is missed.
        await self.feed.start()
        return self

    async def __aenter__(self) -> RunSession:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def submit(
        self, jobs: Sequence[Job], on_result: Callable[[Trajectory], None] | None = None
    ) -> tuple[int, int]:
        """Expect the jobs' trajectories, publish the jobs; returns (published, duplicates)."""
        assert self.producer is not None and self.feed is not None, "start() first"
        self.feed.expect([j.job_id for j in jobs], on_result)
        published, duplicates = await self.producer.publish_jobs(jobs)
        if duplicates:
            # Submitted before (a restarted trainer, a resumed eval): some may be stored already.
            await self.feed.lookup(jobs)
        return published, duplicates

    async def wait(self, timeout: float | None = None) -> dict[str, Trajectory]:
        """Every expected trajectory by job id, or TimeoutError saying how many are missing."""
        assert self.feed is not None, "start() first"
        return await self.feed.wait(timeout)

    def clear(self) -> None:
        """Stop waiting for the current jobs; their late trajectories are ignored."""
        if self.feed is not None:
            self.feed.clear()

    async def close(self) -> None:
        if self.feed is not None:
            await self.feed.close()
        if self.nc is not None and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.nc.close()
