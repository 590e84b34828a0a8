"""The services a TRL run through Agentarium needs beside the local engine, in one test process:
a rollout consumer running the agent and the weight syncer, both against a real nats-server."""

from __future__ import annotations

import asyncio
from pathlib import Path

from worker_env import worker_for

from broker import NatsSettings, Topology, provision
from consumers import ChatTemplate
from consumers.sync import SyncConfig, WeightSyncer


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
