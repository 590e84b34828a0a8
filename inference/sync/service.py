"""``run_sync``: the weight syncer's service (``agentarium sync``): connect, provision, run
until stopped, or apply the current version once."""

from __future__ import annotations

import asyncio
import contextlib
import signal

import structlog

from agentarium.broker import (
    START_PATIENCE_S,
    MetricsServer,
    NatsSettings,
    Topology,
    ensure_provisioned,
)

from .config import SyncConfig
from .syncer import WeightSyncer

log = structlog.get_logger("agentarium.sync")


async def run_sync(
    config: SyncConfig,
    settings: NatsSettings,
    *,
    once: bool = False,
    metrics: MetricsServer | None = None,
) -> int:
    """Run the weight syncer until SIGTERM/SIGINT, or apply the current version once
    (``once``: exit status 1 if any engine failed). ``metrics``, a MetricsServer not yet
    started, serves /metrics and the probes meanwhile (ready: connected to NATS). An engine
    this run may not take over (``--shared-engines``) ends it with ``SyncRefused``, which the
    CLI prints as one line and exit status 1."""
    log.info("sync config", nats=settings.redacted(), once=once, **config.describe())
    nc = await settings.connect(name=f"agentarium-sync-{config.run}")
    try:
        js = nc.jetstream()
        topology = Topology(settings.prefix)
        await ensure_provisioned(js, topology, patience_s=START_PATIENCE_S)
        syncer = WeightSyncer(js, config, topology=topology)
        if metrics is not None:
            metrics.readiness("nats", lambda: nc.is_connected)
            await metrics.start()
        if once:
            result = await syncer.sync_once()
            if result.identity == "default":
                print(f"run {config.run}: no version published yet (the base weights)")
            print(result)
            return 0 if result.ok else 1
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, syncer.stop)
        await syncer.run()
        return 0
    finally:
        if metrics is not None:
            await metrics.close()
        await nc.close()
