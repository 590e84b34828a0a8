"""The orchestrator's async core: broker connection, consumers, publishing, waiting.

It composes the pieces that never import each other: a ``producers.RunSession`` publishes the
jobs and collects the trajectories being waited for, and ``consumers`` run them (in this
process, in Ray actors, or as external ``agentarium consumer`` services).
Without a NATS URL it starts an embedded ``nats-server`` in a temporary directory, so the
seed's three-line integration needs no service to be running.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path

import structlog

from agentarium.broker import Limits, NatsServer, NatsSettings, Topology
from agentarium.consumers import AgentSpec, ConsumerService, ConsumerSpec
from agentarium.formats import ChatTemplate
from agentarium.producers import RunSession, TrajectoryFeed
from agentarium.schemas import Job, Trajectory

from .ray_consumers import RayConfig, RayConsumerPool
from .ray_resources import StallWatch, read_snapshot, task_cpus

log = structlog.get_logger("agentarium.orchestrator")

WATCH_EVERY_S = 1.0


def _stop_embedded(server: NatsServer, store: Path) -> None:
    """Stop an embedded nats-server and remove its store; also runs at exit if the
    orchestrator was never closed, so no nats-server outlives the training script."""
    server.stop()
    shutil.rmtree(store, ignore_errors=True)


class RolloutCore:
    """Runs on the orchestrator's event loop; every method is a coroutine or cheap."""

    def __init__(
        self,
        *,
        settings: NatsSettings | None,
        run: str,
        limits: Limits | None = None,
        ray_config: RayConfig | None = None,
    ) -> None:
        self.settings = settings
        self.run = run
        self.limits = limits or Limits()
        self.ray_config = ray_config
        self.topology = Topology(settings.prefix if settings else "agentarium")
        self.server: NatsServer | None = None
        self._stop_server: weakref.finalize | None = None
        self.session: RunSession | None = None
        self.local: dict[str, ConsumerService] = {}
        self.pool: RayConsumerPool | None = None
        self.ray_agents: dict[str, float] = {}  # Ray remote agents: CPUs per task

    async def start(self) -> None:
        if self.settings is None:
            store = Path(tempfile.mkdtemp(prefix="agentarium-nats-"))
            # The server is a child process; starting it blocks briefly (it polls the port).
            self.server = await asyncio.to_thread(NatsServer(store_dir=store).start)
            self._stop_server = weakref.finalize(self, _stop_embedded, self.server, store)
            self.settings = NatsSettings(url=self.server.url)
            log.info("embedded nats-server started", url=self.server.url, store=str(store))
        self.session = RunSession(
            self.settings, self.run, limits=self.limits, name="agentarium-orchestrator"
        )
        await self.session.start()

    @property
    def feed(self) -> TrajectoryFeed:
        assert self.session is not None and self.session.feed is not None, "start() first"
        return self.session.feed

    # ---- consumers -------------------------------------------------------------------------
    async def start_local(self, spec: ConsumerSpec, template: ChatTemplate | None) -> str:
        assert self.session is not None, "start() first"
        consumer = ConsumerService(self.session.js, self.topology, spec, template=template)
        await consumer.start()
        self.local[spec.agent] = consumer
        self._note_ray_agent(spec)
        return consumer.endpoint_base

    async def start_ray(self, spec: ConsumerSpec, model_ref: str | None) -> list[str]:
        if self.pool is None:
            assert self.ray_config is not None, "start_ray needs a ray_config"
            assert self.settings is not None, "start() first (it sets settings when None)"
            self.pool = await asyncio.to_thread(RayConsumerPool, self.ray_config, self.settings)
        endpoints = await self.pool.start_agent(spec, model_ref)
        self._note_ray_agent(spec)
        return endpoints

    def _note_ray_agent(self, spec: ConsumerSpec) -> None:
        if AgentSpec.of(spec.fn, spec.agent).kind == "ray":
            self.ray_agents[spec.agent] = task_cpus(spec.fn)

    def _consumer_failure(self) -> str | None:
        for name, consumer in self.local.items():
            failure = consumer.failed
            if failure is not None:
                return f"the in-process consumer of agent {name!r} stopped: {failure!r}"
        return None

    # ---- batches ---------------------------------------------------------------------------
    async def submit(
        self, jobs: Sequence[Job], on_result: Callable[[Trajectory], None] | None = None
    ) -> tuple[int, int]:
        """Expect the jobs' trajectories, publish the jobs; returns (published, duplicates)."""
        assert self.session is not None, "start() first"
        return await self.session.submit(jobs, on_result)

    async def wait(self, timeout: float | None = None) -> dict[str, Trajectory]:
        """Every expected trajectory, or TimeoutError; fails early if a local consumer died,
        or if agents' Ray tasks can never get a CPU (and warns when they wait for one)."""
        assert self.session is not None, "start() first"
        waiting = asyncio.create_task(self.session.wait(timeout))
        watch = StallWatch()
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=WATCH_EVERY_S)
                if done:
                    return waiting.result()
                failure = self._consumer_failure()
                if failure is not None:
                    raise RuntimeError(f"{failure}; {self.feed.missing} trajectories missing")
                if self.ray_agents:
                    warning = watch.observe(
                        await asyncio.to_thread(read_snapshot),
                        missing=self.feed.missing,
                        actor_cpus=self.pool.actor_cpus if self.pool else 0.0,
                        agents=self.ray_agents,
                    )
                    if warning is not None:
                        log.warning("agent tasks wait for a CPU", detail=warning)
        finally:
            if not waiting.done():
                waiting.cancel()
                with contextlib.suppress(BaseException):
                    await waiting

    def clear(self) -> None:
        if self.session is not None:
            self.session.clear()

    # ---- shutdown --------------------------------------------------------------------------
    async def close(self) -> None:
        for consumer in list(self.local.values()):
            with contextlib.suppress(Exception):
                await consumer.stop()
        self.local.clear()
        if self.pool is not None:
            with contextlib.suppress(Exception):
                await self.pool.stop()
            self.pool = None
        if self.session is not None:
            await self.session.close()
        if self._stop_server is not None:
            await asyncio.to_thread(self._stop_server)  # runs once, whoever calls it first
            self.server = None
