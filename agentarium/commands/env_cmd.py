"""``agentarium env serve|bridge|status``: environment workers, and what they are doing.

``env serve``'s and ``env bridge``'s settings are the fields of their config dataclasses and
``WorkerSettings``, each one a flag, a key of a --config file and a KEY=VALUE override
(agentarium/commands/config_file.py).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog
import yaml

from broker import Topology, collect_env_status, format_env_status
from environments import (
    BUILTIN,
    Environment,
    EnvironmentLoadError,
    EnvWorker,
    EnvWorkerConfig,
    bridge_class,
    check_options,
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
class WorkerSettings:
    """The worker's settings, shared by ``env serve`` and ``env bridge``."""

    name: str | None = None
    capacity: int = _DEFAULTS.capacity
    max_starting: int = _DEFAULTS.max_starting
    idle_timeout_s: float = _DEFAULTS.idle_timeout_s
    max_observation_bytes: int = _DEFAULTS.max_observation_bytes
    max_request_bytes: int = _DEFAULTS.max_request_bytes
    drain_grace_s: float = _DEFAULTS.drain_grace_s
    worker_id: str = field(default_factory=default_worker_id)


@dataclass(frozen=True, kw_only=True)
class EnvServeConfig:
    """``agentarium env serve``'s own settings: what to serve, built with which options."""

    env: str  # sql | shell | module:Class
    option: tuple[str, ...] | None = None  # KEY=VALUE keywords of the class (YAML values)


def parse_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``KEY=VALUE`` items as keywords; each value read as YAML (``5``, ``{cpu_s: 5}``)."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip().isidentifier():
            raise ValueError(f"--option {item!r}: write KEY=VALUE, e.g. max_steps=20")
        try:
            options[key.strip()] = yaml.safe_load(raw) if raw.strip() else None
        except yaml.YAMLError as exc:
            raise ValueError(f"--option {item!r}: the value is not valid YAML ({exc})") from None
    return options


@dataclass(frozen=True, kw_only=True)
class EnvBridgeConfig:
    """``agentarium env bridge``'s own settings: the AgentBench task worker it fronts."""

    agentbench: str  # the worker's URL
    dialect: str = "auto"
    request_timeout_s: float = 600.0
    score_key: str | None = None


KEYS = ConfigKeys.of(
    "env serve",
    EnvServeConfig,
    WorkerSettings,
    flagless={"env": "the positional ENV argument sets it: `agentarium env serve sql`"},
    keyless={**connection_flags(), **metrics_flags()},
)
BRIDGE_KEYS = ConfigKeys.of(
    "env bridge", EnvBridgeConfig, WorkerSettings, keyless={**connection_flags(), **metrics_flags()}
)


def config_from_args(args: argparse.Namespace) -> tuple[EnvServeConfig, WorkerSettings, dict]:
    if args.env is not None and "=" in args.env:  # `env serve capacity=4`: an override
        args.overrides = [args.env, *(args.overrides or [])]
        args.env = None
    given = [o for o in args.overrides or [] if o.partition("=")[0].strip() == "env"]
    if args.env is None and not args.config and not given:
        raise ValueError(
            "name the environment to serve: agentarium env serve sql|shell|module.path:Class"
        )
    resolved = resolve(args, KEYS)
    return (
        EnvServeConfig(**resolved.pick(EnvServeConfig)),
        WorkerSettings(**resolved.pick(WorkerSettings)),
        resolved.describe(),
    )


def bridge_config_from_args(
    args: argparse.Namespace,
) -> tuple[EnvBridgeConfig, WorkerSettings, dict]:
    resolved = resolve(args, BRIDGE_KEYS)
    return (
        EnvBridgeConfig(**resolved.pick(EnvBridgeConfig)),
        WorkerSettings(**resolved.pick(WorkerSettings)),
        resolved.describe(),
    )


def worker_config(settings: WorkerSettings, name: str) -> EnvWorkerConfig:
    return EnvWorkerConfig(
        name=name,
        capacity=settings.capacity,
        max_starting=settings.max_starting,
        idle_timeout_s=settings.idle_timeout_s,
        max_observation_bytes=settings.max_observation_bytes,
        max_request_bytes=settings.max_request_bytes,
        drain_grace_s=settings.drain_grace_s,
        worker_id=settings.worker_id,
    )


async def run_worker(
    args: argparse.Namespace,
    cls: type[Environment],
    config: EnvWorkerConfig,
    *,
    options: dict[str, Any] | None = None,
    before: Callable[[], Awaitable[None]] | None = None,
) -> int:
    """Serve ``cls`` until drained (SIGTERM); what ``env serve`` and ``env bridge`` share."""
    settings = settings_from_args(args)
    try:
        check_options(cls, options or {})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    nc = await settings.connect(name=f"agentarium-env-{config.name}")
    metrics = metrics_server(args)
    try:
        worker = EnvWorker(nc, Topology(settings.prefix), cls, config, options)
        if metrics is not None:
            metrics.readiness("nats", lambda: nc.is_connected)
            metrics.readiness("environment", lambda: worker.ready)
            await metrics.start()
        if before is not None:
            await before()
        try:
            await worker.start()
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        install_stop_handlers(worker.drain)
        print(
            f"environment {config.name}: worker {config.worker_id} serving "
            f"{config.capacity} sessions on {worker.start_subject}",
            flush=True,
        )
        counters = await worker.wait()
    finally:
        if metrics is not None:
            await metrics.close()
        await nc.close()
    print(
        f"worker {config.worker_id}: starts={counters.starts} steps={counters.steps} "
        f"closed={counters.closed} expired={counters.expired} errors={counters.errors} "
        f"rejected={counters.rejected}",
        file=sys.stderr,
    )
    return 0


async def serve(
    args: argparse.Namespace, config: EnvServeConfig, worker: WorkerSettings, source: dict
) -> int:
    try:
        cls = load_environment(config.env)
        wc = worker_config(worker, service_name(config.env, cls, worker.name))
        options = parse_options(config.option or ())
    except (EnvironmentLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "env serve config",
        **asdict(config),
        **asdict(worker),
        **source,
        service=wc.name,
        env_class=f"{cls.__module__}:{cls.__qualname__}",
        nats=settings_from_args(args).redacted(),
    )
    return await run_worker(args, cls, wc, options=options)


def cmd_serve(args: argparse.Namespace) -> int:
    config, worker, source = config_from_args(args)  # a ValueError: `error: ...`, exit 2
    return run_async(lambda: serve(args, config, worker, source), service="agentarium-env")


async def bridge(
    args: argparse.Namespace, config: EnvBridgeConfig, worker: WorkerSettings, source: dict
) -> int:
    try:
        cls = bridge_class(
            config.agentbench,
            name=worker.name,
            dialect=config.dialect,
            timeout_s=config.request_timeout_s,
            score_key=config.score_key,
        )
        wc = worker_config(worker, service_name("", cls, worker.name))
    except (EnvironmentLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "env bridge config",
        **asdict(config),
        **asdict(worker),
        **source,
        service=wc.name,
        nats=settings_from_args(args).redacted(),
    )

    async def check_worker() -> None:
        """The AgentBench worker's own limit: more sessions than it takes only fail there."""
        try:
            status = await cls.worker_status()
        except Exception as exc:  # noqa: BLE001 - it may come up later: serve anyway
            log.warning("AgentBench worker not reachable yet", url=cls.url, error=str(exc))
            return
        log.info("AgentBench worker", url=cls.url, **status)
        if status.get("concurrency", wc.capacity) < wc.capacity:
            log.warning(
                "--capacity is above the AgentBench worker's concurrency: the extra starts "
                "will be refused there (503) and retried",
                capacity=wc.capacity,
                concurrency=status["concurrency"],
            )

    return await run_worker(args, cls, wc, before=check_worker)


def cmd_bridge(args: argparse.Namespace) -> int:
    config, worker, source = bridge_config_from_args(args)
    return run_async(lambda: bridge(args, config, worker, source), service="agentarium-env")


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


def add_worker_flags(p: argparse.ArgumentParser, default_name: str = "") -> None:
    """The worker's flags (``WorkerSettings``), for ``env serve`` and ``env bridge``."""
    p.add_argument(
        "--name",
        help="the name agents open sessions with (default: "
        + (
            default_name
            or "the built-in's name, else the class's `name`, else its name in lower case"
        )
        + ")",
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


def register(sub: argparse._SubParsersAction) -> None:
    env = sub.add_parser(
        "env",
        help="serve environments (sql, shell, your own) and see their workers",
        description="Environment services: a database, a shell, a game that agents open "
        "sessions with over NATS (docs/design.md, 'Environment sessions').",
    )
    esub = add_command_group(env, "env_command", "{serve,bridge,status}")

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
        "--option",
        action="append",
        metavar="KEY=VALUE",
        help="a keyword the environment class is built with, for every session (repeatable; "
        "the value read as YAML), e.g. --option max_steps=20 --option 'limits={cpu_s: 5}'",
    )
    add_worker_flags(p)
    add_metrics_flags(p)
    add_config_arguments(p, KEYS)
    add_nats_flags(p)
    p.set_defaults(func=cmd_serve)

    b = esub.add_parser(
        "bridge",
        help="serve an AgentBench task worker (HTTP) as an environment, unchanged",
        description="Front a task worker that speaks AgentBench's HTTP task-worker protocol "
        "(/get_indices, /start_sample, /interact, /cancel, /worker_status) as a NATS environment "
        "service: the same worker rules as `env serve` (capacity, seq, expiry, drain, stats). "
        "Both dialects are spoken: AgentBench FC on AgentRL's worker (OpenAI messages and tools) "
        "and classic AgentBench v0.2 text turns. Keep --capacity at most the worker's "
        "concurrency (checked at start). Field mapping: docs/design.md, 'The AgentBench bridge'.",
    )
    b.add_argument(
        "--agentbench",
        required=True,
        metavar="URL",
        help="the task worker's API, as AgentBench's --self writes it (http://host:port/api; a "
        "bare http://host:port gets /api)",
    )
    b.add_argument(
        "--dialect",
        choices=("auto", "fc", "classic"),
        default="auto",
        help="fc (AgentRL's worker), classic (AgentBench v0.2), or auto: told by the first "
        "reply (default %(default)s)",
    )
    b.add_argument(
        "--request-timeout",
        dest="request_timeout_s",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="one HTTP request to the worker; an /interact waits for the environment's turn "
        "(default %(default)s)",
    )
    b.add_argument(
        "--score-key",
        metavar="KEY",
        help="classic: the field of a sample's result holding its score (default: the first "
        "number of score, reward, result, is_correct, correct, success)",
    )
    add_worker_flags(b, default_name="agentbench")
    add_metrics_flags(b)
    add_config_arguments(b, BRIDGE_KEYS)
    add_nats_flags(b)
    b.set_defaults(func=cmd_bridge)

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
