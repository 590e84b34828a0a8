"""The trainer's and the syncer's services: connect, provision, run until stopped.

``agentarium trainer`` and ``agentarium sync`` parse their flags into a ``TrainerConfig`` or
``SyncConfig`` and call these; nothing here knows about argparse.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from nats.js import JetStreamContext

from broker import START_PATIENCE_S, MetricsServer, NatsSettings, Topology, ensure_provisioned

from .config import TrainerConfig
from .errors import TrainerError
from .sync import SyncConfig, WeightSyncer

if TYPE_CHECKING:  # torch loads only when a trainer actually runs, not for --help or a consumer
    from .publishing import WeightPublisher

log = structlog.get_logger("agentarium.trainer")

PublisherFactory = Callable[[JetStreamContext, Topology, TrainerConfig], "WeightPublisher | None"]


def default_weights_dir() -> Path:
    """``$AGENTARIUM_HOME/weights`` (default ``~/.cache/agentarium/weights``)."""
    home = os.environ.get("AGENTARIUM_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "agentarium"
    return base / "weights"


def store_publisher(
    weights_dir: Path | None = None, keep_versions: int | None = None
) -> PublisherFactory:
    """The default: trainer/weights.py's WeightStore (object store, or a shared weights_dir)."""

    def make(js: JetStreamContext, topology: Topology, config: TrainerConfig) -> WeightPublisher:
        from .weights import WeightStore

        kwargs = {} if keep_versions is None else {"keep_versions": keep_versions}
        store = WeightStore(js, topology, weights_dir=weights_dir, **kwargs)
        return store.for_run(config.run)

    return make


async def run_trainer(
    config: TrainerConfig,
    settings: NatsSettings,
    *,
    resume: bool = False,
    max_steps: int | None = None,
    make_publisher: PublisherFactory | None = None,
    torch_threads: int | None = None,
    run_config: Mapping[str, Any] | None = None,
    config_source: Mapping[str, Any] | None = None,
    metrics: MetricsServer | None = None,
) -> int:
    """Run the trainer until ``max_steps`` or SIGTERM/SIGINT (which checkpoint first); 0 on a
    clean stop, 2 on bad settings. ``make_publisher`` builds the WeightPublisher (default:
    ``store_publisher()``); a factory returning None publishes nothing. ``run_config`` is every
    setting as the caller resolved it (the CLI: its config keys), logged with ``config_source``
    (where they came from) in the one "trainer config" event and written to
    ``<checkpoint_dir>/config.yaml``; by default, the config's fields. ``metrics``, a
    MetricsServer not yet started, serves /metrics and the probes while the trainer runs
    (ready: connected to NATS and training)."""
    if torch_threads:
        import torch

        torch.set_num_threads(torch_threads)
    fields = {
        **config.to_log(),
        **(run_config or {}),
        **(config_source or {}),
        "resume": resume,
        "max_steps": max_steps,
        "nats": settings.redacted(),
    }
    fields["model_dir"] = config.model_dir  # the directory loaded, not the name ("tiny") given
    log.info("trainer config", **fields)
    nc = await settings.connect(name=f"agentarium-trainer-{config.run}")
    try:
        js = nc.jetstream()
        topology = Topology(settings.prefix)
        await ensure_provisioned(js, topology, patience_s=START_PATIENCE_S)
        publisher = (make_publisher or store_publisher())(js, topology, config)
        from .loop import Trainer

        trainer = Trainer(
            config,
            js,
            topology=topology,
            publisher=publisher,
            resume=resume,
            run_config=run_config,
        )
        if metrics is not None:
            metrics.readiness("nats", lambda: nc.is_connected)
            metrics.readiness("trainer", lambda: trainer.ready)
            await metrics.start()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, trainer.stop)
        try:
            summary = await trainer.run(max_steps=max_steps)
        except TrainerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            close = getattr(publisher, "close", None)  # a streaming publisher leaves its group
            if close is not None:
                await close()
    finally:
        if metrics is not None:
            await metrics.close()
        await nc.close()
    print(
        f"trainer {config.run}: {summary.steps} steps, version {summary.version}, "
        f"{summary.trained} trajectories trained here, checkpoint {summary.checkpoint}",
        file=sys.stderr,
    )
    return 0


async def run_sync(
    config: SyncConfig,
    settings: NatsSettings,
    *,
    once: bool = False,
    metrics: MetricsServer | None = None,
) -> int:
    """Run the weight syncer until SIGTERM/SIGINT, or apply the current version once
    (``once``: exit status 1 if any engine failed). ``metrics``, a MetricsServer not yet
    started, serves /metrics and the probes meanwhile (ready: connected to NATS)."""
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
            if result is None:
                print(f"run {config.run}: no version published yet")
                return 0
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
