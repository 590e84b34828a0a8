"""The trainer's service: connect, provision, run until stopped.

``agentarium trainer`` parses its flags into a ``TrainerConfig`` and calls this; nothing here
knows about argparse. (The weight syncer's service is inference/sync/service.py.)
"""

from __future__ import annotations

import asyncio
import signal
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog
from nats.js import JetStreamContext

from agentarium.broker import (
    START_PATIENCE_S,
    MetricsServer,
    NatsSettings,
    Topology,
    ensure_provisioned,
)

from .config import TrainerConfig
from .errors import TrainerError

if TYPE_CHECKING:  # torch loads only when a trainer actually runs, not for --help or a consumer
    from .publishing import WeightPublisher

log = structlog.get_logger("agentarium.trainer")

PublisherFactory = Callable[[JetStreamContext, Topology, TrainerConfig], "WeightPublisher | None"]


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
