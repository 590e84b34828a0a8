"""The services a TRL run through Agentarium needs beside the local engine, in one test process:
a rollout consumer running the agent and the weight syncer, both against a real nats-server."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from worker_env import worker_for

from agentarium.broker import NatsSettings, Topology, provision
from agentarium.formats import ChatTemplate
from agentarium.inference.sync import SyncConfig, WeightSyncer
from agentarium.orchestrator.loop_thread import LoopThread


async def trl_services(
    settings: NatsSettings,
    *,
    run: str,
    agent: str,
    agent_fn,
    engine_url: str,
    weights_dir: Path,
    stop: asyncio.Event,
    ready: asyncio.Event,
    model_dir: Path | None = None,
) -> None:
    """The consumer running ``agent_fn`` as ``agent`` and the syncer of ``run`` beside the
    engine (its files under ``weights_dir``), until ``stop``; ``ready`` once both run. The
    consumer renders chats with ``model_dir``'s template (default the tiny model's)."""
    template = model = None
    if model_dir is not None:
        template, model = ChatTemplate.from_model_dir(model_dir), Path(model_dir).name
    nc = await settings.connect(name="trl-test-services")
    try:
        js = nc.jetstream()
        topology = Topology()
        await provision(js, topology)
        syncer = WeightSyncer(
            js,
            SyncConfig(run=run, engines=(engine_url,), weights_dir=weights_dir),
            topology=topology,
        )
        async with worker_for(
            js,
            agent,
            agent_fn,
            [engine_url],
            burst=False,
            concurrency=64,
            template=template,
            model_name=model or "tiny",
        ) as worker:
            tasks = [asyncio.create_task(worker.run()), asyncio.create_task(syncer.run())]
            ready.set()
            await stop.wait()
            worker.stop()
            syncer.stop()
            await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 30)
    finally:
        await nc.close()


@contextlib.contextmanager
def services_running(settings: NatsSettings, *, name: str, **kwargs) -> Iterator[LoopThread]:
    """``trl_services(settings, **kwargs)`` on a loop thread of its own while the block runs
    (yielded, for calls to the engine), stopped and joined after it."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    loop = LoopThread(name=name)
    stop, ready = asyncio.Event(), asyncio.Event()
    services = loop.submit(trl_services(settings, stop=stop, ready=ready, **kwargs))
    try:
        loop.call(asyncio.wait_for(ready.wait(), 60))
        yield loop
    finally:
        loop.loop.call_soon_threadsafe(stop.set)
        services.result(60)
        loop.stop()


class VersionsSeen:
    """A TRL reward function that scores nothing and records, per step, the set of weight
    versions its rollouts were sampled with (``agentarium_weight_version``)."""

    __name__ = "versions_seen"  # TRL names reward functions by it

    def __init__(self) -> None:
        self.steps: list[set[int]] = []

    def __call__(self, completions, agentarium_weight_version, **kwargs):
        self.steps.append(set(agentarium_weight_version))
        return [None] * len(completions)
