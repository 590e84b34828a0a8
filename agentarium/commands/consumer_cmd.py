"""``agentarium consumer``: a rollout worker for one agent.

Its settings are ``consumers.ConsumerProcess``'s fields, each one a flag, a key of a --config file and a
KEY=VALUE override (agentarium/config/).
"""

from __future__ import annotations

import argparse
import sys

import structlog

from agentarium.broker import Topology, tune_gc
from agentarium.consumers import (
    AgentLoadError,
    AgentSpec,
    ConsumerProcess,
    ConsumerService,
    ConsumerSpec,
    Counters,
    LLMTarget,
    build_agent,
    load_callable,
    normalize_urls,
    parse_agent,
)
from agentarium.schemas import settings

from ..config import add_config_arguments, add_settings, resolve
from ..models import model_name, resolve_model
from .common import run_async, settings_from_args
from .service import add_service_flags, install_stop_handlers, probes, service_keys

log = structlog.get_logger("agentarium.cli")


KEYS = service_keys("consumer", ConsumerProcess)


def config_from_args(args: argparse.Namespace) -> tuple[ConsumerProcess, dict]:
    """The settings from defaults, --config, flags and overrides, and where they came from."""
    resolved = resolve(args, KEYS)
    config: ConsumerProcess = resolved.build(ConsumerProcess)
    parse_agent(config.agent, config.rollout.env)
    if not normalize_urls(config.llm) and not config.openai_base:
        raise ValueError(
            "no LLM server: pass --llm URL (repeat it for a fleet), --openai-base URL, or set llm:"
        )
    return config, resolved.describe()


async def consume(args: argparse.Namespace, config: ConsumerProcess, source: dict) -> int:
    nats_settings = settings_from_args(args)
    rollout = config.rollout
    try:
        name, fn = build_agent(config)
        agent = AgentSpec.of(fn, name)
        reward_fn = load_callable(rollout.reward, "reward function") if rollout.reward else None
        model_dir = resolve_model(rollout.model)
    except (AgentLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    name_of_model = rollout.model_name or model_name(rollout.model, model_dir)
    if config.openai_base:  # text in, text out: the server applies its own chat template
        target = LLMTarget(openai_base=config.openai_base.rstrip("/"), openai_model=name_of_model)
    else:
        target = LLMTarget(
            urls=tuple(normalize_urls(config.llm)), lora=config.lora, engine=config.llm_engine
        )
    spec = ConsumerSpec(
        agent=name,
        fn=fn,
        target=target,
        cross=rollout.cross(openai=bool(config.openai_base), engine=config.llm_engine),
        model_dir=str(model_dir),
        model_name=name_of_model,
        reward_fn=reward_fn,
        settings=config.consumer,
    )
    log.info(
        "consumer config",
        **{
            **settings.flatten(config),
            "llm": list(spec.target.urls) or [spec.target.openai_base],
            "cross_model": normalize_urls(list(rollout.cross_model)),
        },
        **source,
        style=agent.style,
        kind=agent.kind,
        model_dir=str(model_dir),
        nats=nats_settings.redacted(),
    )
    nc = await nats_settings.connect(name=f"agentarium-consumer-{name}")
    try:
        service = ConsumerService(nc.jetstream(), Topology(nats_settings.prefix), spec)
        async with probes(args, nc, "consumer", lambda: service.ready):
            await service.start()
            tune_gc()  # after start-up: what exists now is frozen (broker/gc_tuning.py)
            install_stop_handlers(service.drain)
            counters = await service.wait()
    finally:
        await nc.close()
    print(f"worker {spec.settings.worker_id}: {format_counters(counters)}", file=sys.stderr)
    if config.consumer.burst and counters.failed:
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
    name = parse_agent(config.agent, config.rollout.env)[0]
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
    add_settings(p, ConsumerProcess)
    add_config_arguments(p, KEYS)
    add_service_flags(p)
    p.set_defaults(func=cmd_consumer)
