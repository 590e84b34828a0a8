"""``agentarium env serve|bridge|status``: environment workers, and what they are doing.

``env serve``'s and ``env bridge``'s settings are the fields of their config dataclasses, the
worker's own in their section ``EnvWorkerConfig`` (environments/config.py), each one a flag, a
key of a --config file and a KEY=VALUE override (agentarium/config/).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import structlog
import yaml

from agentarium.broker import Topology, collect_env_status, format_env_status
from agentarium.environments import (
    BUILTIN,
    Environment,
    EnvironmentLoadError,
    EnvWorker,
    EnvWorkerConfig,
    bridge_class,
    check_options,
    load_environment,
    service_name,
)
from agentarium.schemas import check_settings, section, setting, settings

from ..config import add_config_arguments, add_settings, resolve
from .common import (
    add_command_group,
    add_nats_flags,
    positive_float,
    run_async,
    settings_from_args,
)
from .service import add_service_flags, install_stop_handlers, probes, service_keys

log = structlog.get_logger("agentarium.cli")


@dataclass(frozen=True, kw_only=True)
class EnvServeConfig:
    """``agentarium env serve``'s settings: what to serve, built with which options, then how
    (``EnvWorkerConfig``, the worker's own)."""

    env: str = setting(flagless="the positional ENV argument sets it: `agentarium env serve sql`")
    option: tuple[str, ...] = setting(
        (),
        metavar="KEY=VALUE",
        help="a keyword the environment class is built with, for every session (repeatable; "
        "the value read as YAML), e.g. --option max_steps=20 --option 'limits={cpu_s: 5}'",
    )
    worker: EnvWorkerConfig = section(EnvWorkerConfig)

    def __post_init__(self) -> None:
        check_settings(self)


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
    """``agentarium env bridge``'s settings: the AgentBench task worker it fronts, then the
    worker's own (``EnvWorkerConfig``)."""

    agentbench: str = setting(
        metavar="URL",
        help="the task worker's API, as AgentBench's --self writes it (http://host:port/api; a "
        "bare http://host:port gets /api)",
    )
    dialect: str = setting(
        "auto",
        choices=("auto", "fc", "classic"),
        help="fc (AgentRL's worker), classic (AgentBench v0.2), or auto: told by the first reply",
    )
    request_timeout_s: float = setting(
        600.0,
        gt=0,
        help="one HTTP request to the worker; an /interact waits for the environment's turn",
    )
    score_key: str | None = setting(
        None,
        metavar="KEY",
        help="classic: the field of a sample's result holding its score (default: the first "
        "number of score, reward, result, is_correct, correct, success)",
    )
    worker: EnvWorkerConfig = section(EnvWorkerConfig)

    def __post_init__(self) -> None:
        check_settings(self)


KEYS = service_keys("env serve", EnvServeConfig)
BRIDGE_KEYS = service_keys("env bridge", EnvBridgeConfig)


def config_from_args(args: argparse.Namespace) -> tuple[EnvServeConfig, dict]:
    """The settings from defaults, --config, flags and overrides, and where they came from."""
    if args.env is not None and "=" in args.env:  # `env serve capacity=4`: an override
        args.overrides = [args.env, *(args.overrides or [])]
        args.env = None
    given = [o for o in args.overrides or [] if o.partition("=")[0].strip() == "env"]
    if args.env is None and not args.config and not given:
        raise ValueError(
            "name the environment to serve: agentarium env serve sql|shell|module.path:Class"
        )
    resolved = resolve(args, KEYS)
    return resolved.build(EnvServeConfig), resolved.describe()


def bridge_config_from_args(args: argparse.Namespace) -> tuple[EnvBridgeConfig, dict]:
    resolved = resolve(args, BRIDGE_KEYS)
    return resolved.build(EnvBridgeConfig), resolved.describe()


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
    try:
        worker = EnvWorker(nc, Topology(settings.prefix), cls, config, options)
        async with probes(args, nc, "environment", lambda: worker.ready):
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
        await nc.close()
    print(
        f"worker {config.worker_id}: starts={counters.starts} steps={counters.steps} "
        f"closed={counters.closed} expired={counters.expired} errors={counters.errors} "
        f"rejected={counters.rejected}",
        file=sys.stderr,
    )
    return 0


async def serve(args: argparse.Namespace, config: EnvServeConfig, source: dict) -> int:
    try:
        cls = load_environment(config.env)
        wc = config.worker.named(service_name(config.env, cls, config.worker.name))
        options = parse_options(config.option)
    except (EnvironmentLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "env serve config",
        **settings.flatten(config),
        **source,
        service=wc.name,
        env_class=f"{cls.__module__}:{cls.__qualname__}",
        nats=settings_from_args(args).redacted(),
    )
    return await run_worker(args, cls, wc, options=options)


def cmd_serve(args: argparse.Namespace) -> int:
    config, source = config_from_args(args)  # a ValueError: `error: ...`, exit 2
    return run_async(lambda: serve(args, config, source), service="agentarium-env")


async def bridge(args: argparse.Namespace, config: EnvBridgeConfig, source: dict) -> int:
    try:
        cls = bridge_class(
            config.agentbench,
            name=config.worker.name,
            dialect=config.dialect,
            timeout_s=config.request_timeout_s,
            score_key=config.score_key,
        )
        wc = config.worker.named(service_name("", cls, config.worker.name))
    except (EnvironmentLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "env bridge config",
        **settings.flatten(config),
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
    config, source = bridge_config_from_args(args)
    return run_async(lambda: bridge(args, config, source), service="agentarium-env")


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
    esub = add_command_group(env, "env_command", "{serve,bridge,status}")

    p = esub.add_parser(
        "serve",
        help="serve an environment as a NATS service: sessions, capacity, drain on SIGTERM",
        description="Serve one environment as a NATS micro service (discovery and stats on "
        "$SRV.PING/INFO/STATS). A session starts through the service's queue group (any worker "
        "with room takes it; a full worker stops listening, so a start finding no room backs off) "
        "and every later step goes to the worker that holds it. Idle sessions expire; SIGTERM "
        "drains: no new sessions, open ones finish or expire (at most --drain-grace), then exit. "
        "Settings may come from --config FILE.yaml and KEY=VALUE overrides. The shell "
        "environment runs each session in its own namespaces and cgroup, which needs root and "
        "bubblewrap: where the host lacks any of it the worker refuses to start, naming what is "
        "missing, unless --option allow_weaker_sandbox=true accepts the weaker sandbox.",
    )
    p.add_argument(
        "env",
        nargs="?",
        metavar="ENV",
        help=f"a built-in environment ({', '.join(sorted(BUILTIN))}) or module.path:Class (a "
        "subclass of environments.Environment)",
    )
    add_settings(p, EnvServeConfig)
    add_config_arguments(p, KEYS)
    add_service_flags(p)
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
    add_settings(b, EnvBridgeConfig)
    add_config_arguments(b, BRIDGE_KEYS)
    add_service_flags(b)
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
        type=positive_float,
        default=1.0,
        metavar="SECONDS",
        help="how long to wait for workers to answer (default %(default)s)",
    )
    add_nats_flags(s)
    s.set_defaults(func=cmd_status)
