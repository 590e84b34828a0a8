"""``agentarium sync``: the weight syncer beside an engine fleet (inference.sync.run_sync).

Its settings are ``SyncCommand``'s fields: the syncer's ``SyncConfig`` and the command's own
``--once``, each one a flag.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from agentarium.inference.sync import SyncConfig, run_sync
from agentarium.schemas import section, setting

from ..config import ConfigKeys, add_settings, resolve
from .common import run_async, settings_from_args
from .service import add_service_flags, metrics_server


@dataclass(frozen=True, kw_only=True)
class SyncCommand:
    """What to keep in step (``SyncConfig``), then how long: for good, or one round."""

    sync: SyncConfig = section(SyncConfig)
    once: bool = setting(
        False, help="apply the current version to every engine and exit (status 1 if any failed)"
    )


# no --config: the keys say how flags become SyncCommand (the NATS and metrics flags are
# the deployment's, read by common.py)
KEYS = ConfigKeys.of("sync", SyncCommand)


def add_sync_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``agentarium sync`` (NATS connection flags are added by the caller)."""
    add_settings(parser, SyncCommand)


def command_from_args(args: argparse.Namespace) -> SyncCommand:
    command: SyncCommand = resolve(args, KEYS).build(SyncCommand)
    return command


def config_from_args(args: argparse.Namespace) -> SyncConfig:
    return command_from_args(args).sync


def cmd_sync(args: argparse.Namespace) -> int:
    command = command_from_args(args)
    return run_async(
        lambda: run_sync(
            command.sync,
            settings_from_args(args),
            once=command.once,
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
    add_service_flags(parser)
    parser.set_defaults(func=cmd_sync)
