"""``agentarium sync``: the weight syncer beside an engine fleet (trainer.run_sync)."""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer import PAUSE_MODES, SyncConfig, default_weights_dir, run_sync

from .common import (
    add_metrics_flags,
    add_nats_flags,
    metrics_server,
    run_async,
    settings_from_args,
)


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


def cmd_sync(args: argparse.Namespace) -> int:
    return run_async(
        lambda: run_sync(
            config_from_args(args),
            settings_from_args(args),
            once=args.once,
            metrics=metrics_server(args),
        ),
        service="agentarium-sync",
    )


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "sync",
        help="watch a run's policy versions and reload engines with the new weights",
        description="The weight syncer, run beside each engine fleet with access to its disk: watches the policy "
        "KV, fetches and verifies (sha256) the new safetensors, and reloads every engine with "
        "pause -> /update_weights_from_disk -> continue (SGLang and the local engine alike).",
    )
    add_sync_arguments(parser)
    add_metrics_flags(parser)
    add_nats_flags(parser)
    parser.set_defaults(func=cmd_sync)
