"""``agentarium consumer``: a rollout worker for one agent.

Its settings are ``ConsumerConfig``'s fields, each one a flag, a key of a --config file and a
KEY=VALUE override (agentarium/commands/config_file.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog

from broker import Topology, tune_gc
from consumers import (
    AgentLoadError,
    AgentSpec,
    ConsumerService,
    ConsumerSpec,
    Counters,
    CrossTarget,
    FleetPolicy,
    LLMTarget,
    default_worker_id,
    env_agent,
    load_callable,
    normalize_urls,
)
from schemas import SchemaError, check_name

from ..tiny import resolve_model
from .common import (
    add_metrics_flags,
    add_nats_flags,
    install_stop_handlers,
    metrics_server,
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


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    """The consumer command's settings; ``ConsumerSpec`` is built from them."""

    agent: str  # NAME=module:function, or NAME with env
    llm: tuple[str, ...]
    # The generic function-call agent (consumers/env_agent.py) on this environment, for a
    # bare agent NAME; max_turns: its model calls per rollout.
    env: str | None = None
    max_turns: int = 10
    model: str = "tiny"
    model_name: str | None = None
    concurrency: int = 32
    reward: str | None = None
    burst: bool = False
    attempts: int = 3
    retry_delay_s: float = 1.0
    ack_wait_s: float = 60.0
    drain_grace_s: float = 30.0
    llm_retries: int = 3
    llm_timeout_s: float = 600.0
    # An outage of the whole LLM fleet: pulling pauses and rollouts wait this long for it
    # before failing as errors (0: never wait); servers are probed every interval.
    fleet_outage_limit_s: float = 300.0
    fleet_probe_interval_s: float = 5.0
    fleet_probe_timeout_s: float = 5.0
    proxy_host: str | None = None  # None: loopback, or all interfaces with --advertise-host
    proxy_port: int = 0
    advertise_host: str | None = None
    worker_id: str = field(default_factory=default_worker_id)
    # Cross-sampling (as `eval run --cross-model`): a call goes to this second model with
    # probability cross_ratio; recorded with policy false, never trained on.
    cross_model: tuple[str, ...] | None = None
    cross_model_name: str = "cross"
    cross_ratio: float = 0.5


KEYS = ConfigKeys.of("consumer", ConsumerConfig, keyless={**connection_flags(), **metrics_flags()})


def parse_agent(value: str, env: str | None = None) -> tuple[str, str]:
    """``NAME=module:function`` -> (NAME, module:function); a bare NAME with ``env`` -> (NAME,
    "") for the generic function-call agent on that environment."""
    name, sep, spec = value.partition("=")
    if sep and env:
        raise ValueError(
            f"--agent {value!r} names its own rollout function, and --env {env} asks for the "
            f"generic function-call agent: pass --agent {name} --env {env}, or drop --env"
        )
    if not sep and not env:
        raise ValueError(
            f"--agent {value!r}: write NAME=module:function, e.g. toy=examples.toy:rollout, "
            f"or NAME with --env ENV for the generic agent on an environment (--agent {value} "
            "--env sql)"
        )
    try:
        check_name(name, "agent")
        if env:
            check_name(env, "env")
    except SchemaError as exc:
        raise ValueError(str(exc)) from None
    return name, spec


def build_agent(config: ConsumerConfig) -> tuple[str, Any]:
    """The agent's name and callable: the generic agent with ``env``, else the imported
    function (``load_callable``)."""
    name, spec_text = parse_agent(config.agent, config.env)
    if config.env:
        return name, env_agent(config.env, max_turns=config.max_turns)
    return name, load_callable(spec_text, "agent")


def config_from_args(args: argparse.Namespace) -> tuple[ConsumerConfig, dict]:
    """The settings from defaults, --config, flags and overrides, and where they came from."""
    resolved = resolve(args, KEYS)
    config = ConsumerConfig(**resolved.pick(ConsumerConfig))
    parse_agent(config.agent, config.env)
    if config.max_turns < 1:
        raise ValueError(f"--max-turns must be >= 1, got {config.max_turns}")
    if not normalize_urls(config.llm):
        raise ValueError("no LLM server: pass --llm URL (repeat it for a fleet) or set llm:")
    if not 0.0 <= config.cross_ratio <= 1.0:
        raise ValueError(f"--cross-ratio must be in [0, 1], got {config.cross_ratio}")
    if config.fleet_outage_limit_s < 0:
        raise ValueError(f"--fleet-outage-limit must be >= 0, got {config.fleet_outage_limit_s}")
    if config.fleet_probe_interval_s <= 0 or config.fleet_probe_timeout_s <= 0:
        raise ValueError("--fleet-probe-interval and --fleet-probe-timeout must be > 0")
    return config, resolved.describe()


async def consume(args: argparse.Namespace, config: ConsumerConfig, source: dict) -> int:
    settings = settings_from_args(args)
    try:
        name, fn = build_agent(config)
        agent = AgentSpec.of(fn, name)
        reward_fn = load_callable(config.reward, "reward function") if config.reward else None
        model_dir = resolve_model(config.model)
    except (AgentLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cross_urls = normalize_urls(list(config.cross_model or ()))
    cross = (
        CrossTarget(
            target=LLMTarget(urls=tuple(cross_urls)),
            ratio=config.cross_ratio,
            name=config.cross_model_name,
        )
        if cross_urls
        else None
    )
    spec = ConsumerSpec(
        agent=name,
        fn=fn,
        target=LLMTarget(urls=tuple(normalize_urls(config.llm))),
        cross=cross,
        model_dir=str(model_dir),
        model_name=config.model_name or ("tiny" if config.model == "tiny" else model_dir.name),
        concurrency=config.concurrency,
        proxy_host=config.proxy_host,
        proxy_port=config.proxy_port,
        advertise_host=config.advertise_host,
        attempts=config.attempts,
        retry_delay_s=config.retry_delay_s,
        ack_wait_s=config.ack_wait_s,
        drain_grace_s=config.drain_grace_s,
        llm_retries=config.llm_retries,
        llm_timeout_s=config.llm_timeout_s,
        fleet=FleetPolicy(
            outage_limit_s=config.fleet_outage_limit_s,
            probe_interval_s=config.fleet_probe_interval_s,
            probe_timeout_s=config.fleet_probe_timeout_s,
        ),
        fetch_timeout_s=1.0,
        burst=config.burst,
        worker_id=config.worker_id,
        reward_fn=reward_fn,
    )
    log.info(
        "consumer config",
        **{**asdict(config), "llm": list(spec.target.urls), "cross_model": cross_urls},
        **source,
        style=agent.style,
        kind=agent.kind,
        model_dir=str(model_dir),
        nats=settings.redacted(),
    )
    nc = await settings.connect(name=f"agentarium-consumer-{name}")
    metrics = metrics_server(args)
    try:
        service = ConsumerService(nc.jetstream(), Topology(settings.prefix), spec)
        if metrics is not None:
            metrics.readiness("nats", lambda: nc.is_connected)
            metrics.readiness("consumer", lambda: service.ready)
            await metrics.start()
        await service.start()
        tune_gc()  # after start-up: what exists now is frozen (broker/gc_tuning.py)
        install_stop_handlers(service.drain)
        counters = await service.wait()
    finally:
        if metrics is not None:
            await metrics.close()
        await nc.close()
    print(f"worker {spec.worker_id}: {format_counters(counters)}", file=sys.stderr)
    if config.burst and counters.failed:
        print(
            f"error: {counters.failed} rollout(s) of agent {name!r} failed (errors {counters.errors}, "
            f"timeouts {counters.timeouts}, dead-lettered {counters.dead_lettered}); the "
            "warnings above give the reasons, `agentarium trajectories show --status error` "
            "the stored ones",
            file=sys.stderr,
        )
        return 1
    return 0


def format_counters(counters: Counters) -> str:
    return " ".join(f"{k}={v}" for k, v in vars(counters).items())


def cmd_consumer(args: argparse.Namespace) -> int:
    config, source = config_from_args(args)  # a ValueError: `error: ...`, exit 2 (agentarium.cli)
    name = parse_agent(config.agent, config.env)[0]
    return run_async(lambda: consume(args, config, source), service=f"agentarium-consumer-{name}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "consumer",
        help="run a rollout worker for one agent",
        description="Pull jobs for one agent from JetStream, run the agent with a tracing LLM client, and store "
        "one trajectory per job. Any number of consumers may run on the same agent and share its queue. "
        "With --env ENV and a bare --agent NAME, the agent is the generic function-call agent on an "
        "environment service (agentarium env serve ENV): no code of yours runs. "
        "SIGTERM drains: no new jobs, in-flight ones finish within --drain-grace, the rest are released. "
        "Settings may come from --config FILE.yaml and KEY=VALUE overrides (defaults < file < flags < "
        "overrides); the resolved ones are logged once.",
    )
    p.add_argument(
        "--agent",
        required=True,
        metavar="NAME=module:function|NAME",
        help="agent name and its rollout function, e.g. toy=examples.toy:rollout. The function is "
        "rollout(task, llm) (async or not) or rollout(task, endpoint, model), or a Ray remote "
        "function. A bare NAME with --env runs the generic function-call agent instead",
    )
    p.add_argument(
        "--env",
        default=None,
        metavar="ENV",
        help="run the generic function-call agent on environment ENV (`agentarium env serve "
        "ENV`), no code needed: each job's task opens a session, the model calls the "
        "environment's tools until it is done or --max-turns, and the reward is the session's "
        "score. Give --agent a bare NAME with it, e.g. --agent db --env sql",
    )
    p.add_argument(
        "--max-turns",
        type=int,
        default=10,
        metavar="N",
        help="with --env: model calls per rollout before the episode is cut (truncated, scored "
        "as the environment scores it at close) (default %(default)s)",
    )
    p.add_argument(
        "--llm",
        action="append",
        required=True,
        metavar="URL",
        help="SGLang-compatible server (or `agentarium engine`); repeat for a fleet: least-loaded "
        "balancing, every sample of a group on the same server",
    )
    p.add_argument(
        "--model",
        default="tiny",
        metavar="PATH|tiny",
        help="model directory whose tokenizer and chat template render prompts (default: the built-in tiny model)",
    )
    p.add_argument(
        "--model-name",
        default=None,
        help="model name handed to endpoint-style agents and spans (default: from --model)",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="rollouts run at once in this process (default %(default)s)",
    )
    p.add_argument(
        "--reward",
        metavar="module:fn",
        help="reward function fn(task, result, trajectory) -> float | dict",
    )
    p.add_argument(
        "--burst",
        action="store_true",
        help="exit once the agent's queue is empty and nothing is in flight",
    )
    p.add_argument(
        "--attempts",
        type=int,
        default=3,
        help="runs of a failing job before it is dead-lettered; a delivery lost to a crashed or "
        "drained worker spends none (default %(default)s)",
    )
    p.add_argument(
        "--retry-delay",
        dest="retry_delay_s",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="first retry delay; doubles per attempt, capped at 60 s (default %(default)s)",
    )
    p.add_argument(
        "--ack-wait",
        dest="ack_wait_s",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="redelivery timeout; in-flight jobs are heartbeated every third of it (default %(default)s)",
    )
    p.add_argument(
        "--drain-grace",
        dest="drain_grace_s",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM, how long in-flight rollouts may finish before release (default %(default)s)",
    )
    p.add_argument(
        "--llm-retries",
        type=int,
        default=3,
        help="retries per LLM call before failing over (default %(default)s)",
    )
    p.add_argument(
        "--llm-timeout",
        dest="llm_timeout_s",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="per LLM request (default %(default)s)",
    )
    p.add_argument(
        "--fleet-outage-limit",
        dest="fleet_outage_limit_s",
        type=float,
        default=300.0,
        metavar="SECONDS",
        help="when every LLM server stops answering, pull no new jobs and hold in-flight "
        "rollouts (no attempt spent, deadlines paused) until one answers; only an outage longer "
        "than this fails them as errors. 0: never hold, inf: hold for ever (default %(default)s)",
    )
    p.add_argument(
        "--fleet-probe-interval",
        dest="fleet_probe_interval_s",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="health probe (GET /health) period of each LLM server not answering calls "
        "(default %(default)s)",
    )
    p.add_argument(
        "--fleet-probe-timeout",
        dest="fleet_probe_timeout_s",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="a server that does not answer its probe within this long is skipped, and its "
        "requests in flight fail over (two misses in a row) (default %(default)s)",
    )
    p.add_argument(
        "--proxy-host",
        default=None,
        help="bind address of the OpenAI-compatible tracing proxy, which endpoint-style agents "
        "call (each rollout's URL carries its own secret). Default: 127.0.0.1, agents on this "
        "machine; 0.0.0.0 when --advertise-host names another address, for agents on other "
        "machines or containers",
    )
    p.add_argument(
        "--proxy-port",
        type=int,
        default=0,
        help="proxy port; 0 picks a free one (default %(default)s)",
    )
    p.add_argument(
        "--advertise-host",
        default=None,
        help="host name put in the per-rollout endpoint URLs, for agents on other machines "
        "(default: the --proxy-host address, or this host's when that is 0.0.0.0)",
    )
    p.add_argument(
        "--cross-model",
        action="append",
        metavar="URL",
        help="cross-sampling: a second model's server (SGLang or `agentarium engine`; repeat for "
        "a fleet) sharing the policy's tokenizer (checked at start); each LLM call goes there "
        "with probability --cross-ratio, and is recorded as not the policy's: the trainer keeps "
        "its tokens as context and trains only on the policy's",
    )
    p.add_argument(
        "--cross-model-name",
        default="cross",
        metavar="NAME",
        help="the second model's name in the recorded calls (default %(default)s)",
    )
    p.add_argument(
        "--cross-ratio",
        type=float,
        default=0.5,
        metavar="P",
        help="probability that a call goes to --cross-model, decided per call (default %(default)s)",
    )
    p.add_argument(
        "--worker-id",
        help="name in the workers registry (default: host-pid-random)",
    )
    add_metrics_flags(p)
    add_config_arguments(p, KEYS)
    add_nats_flags(p)
    p.set_defaults(func=cmd_consumer)
