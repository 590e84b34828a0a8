"""``agentarium env serve|status``: environment workers, and what they are doing.

``env serve``'s settings are ``EnvServeConfig``'s fields, each one a flag, a key of a --config
file and a KEY=VALUE override (agentarium/commands/config_file.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field

import structlog

from broker import Topology, collect_env_status, format_env_status
from environments import (
    BUILTIN,
    EnvironmentLoadError,
    EnvWorker,
    EnvWorkerConfig,
    default_worker_id,
    load_environment,
    service_name,
)

from .common import (
    add_command_group,
    add_metrics_flags,
    add_nats_flags,
    install_stop_handlers,
    metrics_server,
    positive_int,
    run_async,
    settings_from_args,
)
from .config_file import (
    ConfigKeys,
    add_config_arguments,
    connection_flags,
    metrics_flags,
    resolve,
)

log = structlog.get_logger("agentarium.cli")

_DEFAULTS = EnvWorkerConfig(name="x", worker_id="x")


@dataclass(frozen=True, kw_only=True)
class EnvServeConfig:
    """``agentarium env serve``'s settings; ``EnvWorkerConfig`` is built from them."""

    env: str  # sql | shell | module:Class
    name: str | None = None
    capacity: int = _DEFAULTS.capacity
    max_starting: int = _DEFAULTS.max_starting
    idle_timeout_s: float = _DEFAULTS.idle_timeout_s
    max_observation_bytes: int = _DEFAULTS.max_observation_bytes
    max_request_bytes: int = _DEFAULTS.max_request_bytes
    drain_grace_s: float = _DEFAULTS.drain_grace_s
    worker_id: str = field(default_factory=default_worker_id)


KEYS = ConfigKeys.of(
    "env serve",
    EnvServeConfig,
    flagless={"env": "the positional ENV argument sets it: `agentarium env serve sql`"},
    keyless={**connection_flags(), **metrics_flags()},
)


def config_from_args(args: argparse.Namespace) -> tuple[EnvServeConfig, dict]:
    if args.env is not None and "=" in args.env:  # `env serve capacity=4`: an override
        args.overrides = [args.env, *(args.overrides or [])]
        args.env = None
    given = [o for o in args.overrides or [] if o.partition("=")[0].strip() == "env"]
    if args.env is None and not args.config and not given:
        raise ValueError(
            "name the environment to serve: agentarium env serve sql|shell|module.path:Class"
        )
    resolved = resolve(args, KEYS)
    return EnvServeConfig(**resolved.pick(EnvServeConfig)), resolved.describe()


async def serve(args: argparse.Namespace, config: EnvServeConfig, source: dict) -> int:
    settings = settings_from_args(args)
    try:
        cls = load_environment(config.env)
        name = service_name(config.env, cls, config.name)
        worker_config = EnvWorkerConfig(
            name=name,
            capacity=config.capacity,
            max_starting=config.max_starting,
            idle_timeout_s=config.idle_timeout_s,
            max_observation_bytes=config.max_observation_bytes,
            max_request_bytes=config.max_request_bytes,
            drain_grace_s=config.drain_grace_s,
            worker_id=config.worker_id,
        )
    except (EnvironmentLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "env serve config",
        **asdict(config),
        **source,
        service=name,
        env_class=f"{cls.__module__}:{cls.__qualname__}",
        nats=settings.redacted(),
    )
    nc = await settings.connect(name=f"agentarium-env-{name}")
    metrics = metrics_server(args)
    try:
        worker = EnvWorker(nc, Topology(settings.prefix), cls, worker_config)
        if metrics is not None:
            metrics.readiness("nats", lambda: nc.is_connected)
            metrics.readiness("environment", lambda: worker.ready)
            await metrics.start()
        try:
            await worker.start()
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        install_stop_handlers(worker.drain)
        print(
            f"environment {name}: worker {worker_config.worker_id} serving "
            f"{worker_config.capacity} sessions on {worker.start_subject}",
            flush=True,
        )
        counters = await worker.wait()
    finally:
        if metrics is not None:
            await metrics.close()
        await nc.close()
    print(
        f"worker {worker_config.worker_id}: starts={counters.starts} steps={counters.steps} "
        f"closed={counters.closed} expired={counters.expired} errors={counters.errors} "
        f"rejected={counters.rejected}",
        file=sys.stderr,
    )
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    config, source = config_from_args(args)  # a ValueError: `error: ...`, exit 2
    return run_async(lambda: serve(args, config, source), service="agentarium-env")


async def _status(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    nc = await settings.connect(name="agentarium-env-status", reconnect_forever=False)
    try:
        services = await collect_env_status(nc, Topology(settings.prefix), timeout_s=args.timeout)
    finally:
        await nc.close()
    if args.json:
        print(json.dumps([s.to_json() for s in services], indent=2))
    else:
        print(format_env_status(services))
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    return run_async(lambda: _status(args), service="agentarium-env")


def register(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser(
        "env",
        help="serve environments (sql, shell, your own) and see their workers",
        description="Environment services: a database, a shell, a game that agents open "
        "sessions with over NATS (docs/design.md, 'Environment sessions').",
    )
    esub = add_command_group(env, "env_command", "{serve,status}")

    p = esub.add_parser(
        "serve",
        help="serve an environment as a NATS service: sessions, capacity, drain on SIGTERM",
        description="Serve one environment as a NATS micro service (discovery and stats on "
        "$SRV.PING/INFO/STATS). A session starts through the service's queue group (any worker "
        "with room takes it; a full worker stops listening, so a start finding no room backs off) "
        "and every later step goes to the worker that holds it. Idle sessions expire; SIGTERM "
        "drains: no new sessions, open ones finish or expire (at most --drain-grace), then exit. "
        "Settings may come from --config FILE.yaml and KEY=VALUE overrides.",
    )
    p.add_argument(
        "env",
        nargs="?",
        metavar="ENV",
        help=f"a built-in environment ({', '.join(sorted(BUILTIN))}) or module.path:Class (a "
        "subclass of environments.Environment)",
    )
    p.add_argument(
        "--name",
        help="the name agents open sessions with (default: the built-in's name, else the "
        "class's `name`, else its name in lower case)",
    )
    p.add_argument(
        "--capacity",
        type=positive_int,
        default=_DEFAULTS.capacity,
        metavar="N",
        help="sessions this worker holds at once; when full it takes no start (default %(default)s)",
    )
    p.add_argument(
        "--max-starting",
        type=positive_int,
        default=_DEFAULTS.max_starting,
        metavar="K",
        help="starts (resets) run at once, so expensive environments start a few at a time "
        "(default %(default)s)",
    )
    p.add_argument(
        "--idle-timeout",
        dest="idle_timeout_s",
        type=float,
        default=_DEFAULTS.idle_timeout_s,
        metavar="SECONDS",
        help="a session with no request for this long is closed (default %(default)s)",
    )
    p.add_argument(
        "--max-observation-bytes",
        type=positive_int,
        default=_DEFAULTS.max_observation_bytes,
        metavar="B",
        help="the most bytes of one reply; a bigger observation has its longest texts cut, "
        "with a marker, and says truncated. Keep it well under the server's max_payload "
        "(default %(default)s)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=_DEFAULTS.max_request_bytes,
        metavar="B",
        help="a step or close bigger than this is refused with 413 (default %(default)s)",
    )
    p.add_argument(
        "--drain-grace",
        dest="drain_grace_s",
        type=float,
        default=_DEFAULTS.drain_grace_s,
        metavar="SECONDS",
        help="on SIGTERM, how long open sessions may finish before they are closed "
        "(default %(default)s)",
    )
    p.add_argument(
        "--worker-id",
        help="this worker's id, a subject token (default: host-pid-random)",
    )
    add_metrics_flags(p)
    add_config_arguments(p, KEYS)
    add_nats_flags(p)
    p.set_defaults(func=cmd_serve)

    s = esub.add_parser(
        "status",
        help="environment workers: sessions open/max, starts/s, step latency, errors",
        description="Every environment worker of this prefix, from the NATS service API "
        "($SRV.STATS): sessions open of the most it holds, starts per second, step latency "
        "p50/p99 (milliseconds, last 2,048 steps), errors (the environment raised) and "
        "expired sessions; per environment, then per worker.",
    )
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")
    s.add_argument(
        "--timeout",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how long to wait for workers to answer (default %(default)s)",
    )
    add_nats_flags(s)
    s.set_defaults(func=cmd_status)
