"""``agentarium sync``: flags and the command body around trainer/sync.py's WeightSyncer."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
from pathlib import Path

import structlog

from broker import NatsSettings, Topology
from broker.provision import ensure_provisioned

from .sync import PAUSE_MODES, SyncConfig, WeightSyncer

log = structlog.get_logger("agentarium.sync")


def default_weights_dir() -> Path:
    """``$AGENTARIUM_HOME/weights`` (default ``~/.cache/agentarium/weights``)."""
    home = os.environ.get("AGENTARIUM_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "agentarium"
    return base / "weights"


def add_sync_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``agentarium sync`` (NATS connection flags are added by the caller)."""
    parser.add_argument("--run", required=True, help="run id whose policy versions to follow")
    parser.add_argument(
        "--engine",
        dest="engines",
        action="append",
        required=True,
        metavar="URL",
        help="engine base URL (SGLang or the local engine), e.g. http://127.0.0.1:30000; "
        "repeat for every engine that shares this machine's disk",
    )
    parser.add_argument(
        "--weights-dir",
        type=Path,
        default=None,
        metavar="DIR",
        help="local directory the engines read new weights from, as DIR/RUN/vN/"
        "model.safetensors (default $AGENTARIUM_HOME/weights, i.e. ~/.cache/agentarium/weights)",
    )
    parser.add_argument(
        "--shared-path",
        action="store_true",
        help="the trainer publishes to a shared filesystem (its --weights-dir) mounted at the "
        "same path here: verify and load those files in place instead of copying them into "
        "--weights-dir",
    )
    parser.add_argument(
        "--keep",
        type=int,
        default=2,
        metavar="K",
        help="local versions to keep in --weights-dir (default %(default)s)",
    )
    parser.add_argument(
        "--pause-mode",
        choices=PAUSE_MODES,
        default="in_place",
        help="how /pause_generation holds requests during a reload (default %(default)s)",
    )
    parser.add_argument(
        "--recheck-s",
        type=float,
        default=30.0,
        metavar="S",
        help="also re-read the policy KV and re-check every engine's version this often, to "
        "catch a restarted engine or a lost watch (default %(default)s)",
    )
    parser.add_argument(
        "--update-timeout-s",
        type=float,
        default=600.0,
        metavar="S",
        help="longest wait for one engine's /update_weights_from_disk (default %(default)s)",
    )
    parser.add_argument(
        "--once",
        action="store_true",
        help="apply the current version to every engine and exit (status 1 if any failed)",
    )


def config_from_args(args: argparse.Namespace) -> SyncConfig:
    return SyncConfig(
        run=args.run,
        engines=tuple(args.engines),
        weights_dir=(args.weights_dir or default_weights_dir()).expanduser().resolve(),
        shared_path=args.shared_path,
        keep=args.keep,
        pause_mode=args.pause_mode,
        recheck_s=args.recheck_s,
        update_timeout_s=args.update_timeout_s,
    )


async def run_sync(args: argparse.Namespace, settings: NatsSettings) -> int:
    """``agentarium sync``: run the syncer until SIGTERM/SIGINT (or once with --once)."""
    config = config_from_args(args)
    log.info("sync config", nats=settings.redacted(), once=args.once, **config.describe())
    nc = await settings.connect(name=f"agentarium-sync-{config.run}")
    try:
        js = nc.jetstream()
        topology = Topology(settings.prefix)
        await ensure_provisioned(js, topology)
        syncer = WeightSyncer(js, config, topology=topology)
        if args.once:
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
        await nc.close()
