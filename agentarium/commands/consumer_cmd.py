"""``agentarium consumer``: a rollout worker for one agent.

Its settings are ``ConsumerConfig``'s fields, each one a flag, a key of a --config file and a
KEY=VALUE override (agentarium/commands/config_file.py).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any

import structlog

from broker import Topology, tune_gc
from consumers import (
    AgentLoadError,
    AgentSpec,
    ConsumerService,
    ConsumerSettings,
    ConsumerSpec,
    Counters,
    CrossTarget,
    LLMTarget,
    env_agent,
    load_callable,
    normalize_urls,
)
from schemas import SchemaError, check_name, check_settings, section, setting, settings

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
    add_settings,
    connection_flags,
    metrics_flags,
    resolve,
)

log = structlog.get_logger("agentarium.cli")


@dataclass(frozen=True, kw_only=True)
class ConsumerConfig:
    """The consumer command's settings: what to run (the agent, its model and LLM servers),
    then how (``ConsumerSettings``, the consumer's own)."""

    agent: str = setting(
        metavar="NAME=module:function|NAME",
        help="agent name and its rollout function, e.g. toy=examples.toy:rollout. The function "
        "is rollout(task, llm) (async or not) or rollout(task, endpoint, model), or a Ray "
        "remote function. A bare NAME with --env runs the generic function-call agent instead",
    )
    llm: tuple[str, ...] = setting(
        metavar="URL",
        help="SGLang-compatible server (or `agentarium engine`); repeat for a fleet: "
        "least-loaded balancing, every sample of a group on the same server",
    )
    env: str | None = setting(
        None,
        metavar="ENV",
        help="run the generic function-call agent on environment ENV (`agentarium env serve "
        "ENV`), no code needed: each job's task opens a session, the model calls the "
        "environment's tools until it is done or --max-turns, and the reward is the session's "
        "score. Give --agent a bare NAME with it, e.g. --agent db --env sql",
    )
    max_turns: int = setting(
        10,
        ge=1,
        metavar="N",
        help="with --env: model calls per rollout before the episode is cut (truncated, scored "
        "as the environment scores it at close)",
    )
    model: str = setting(
        "tiny",
        metavar="PATH|tiny",
        help="model directory whose tokenizer and chat template render prompts (default: the "
        "built-in tiny model)",
    )
    model_name: str | None = setting(
        None, help="model name handed to endpoint-style agents and spans (default: from --model)"
    )
    reward: str | None = setting(
        None,
        metavar="module:fn",
        help="reward function fn(task, result, trajectory) -> float | dict",
    )
    # Cross-sampling (as `eval run --cross-model`): a call goes to this second model with
    # probability cross_ratio; recorded with policy false, never trained on.
    cross_model: tuple[str, ...] = setting(
        (),
        metavar="URL",
        help="cross-sampling: a second model's server (SGLang or `agentarium engine`; repeat "
        "for a fleet) sharing the policy's tokenizer (checked at start); each LLM call goes "
        "there with probability --cross-ratio, and is recorded as not the policy's: the trainer "
        "keeps its tokens as context and trains only on the policy's",
    )
    cross_model_name: str = setting(
        "cross", metavar="NAME", help="the second model's name in the recorded calls"
    )
    cross_ratio: float = setting(
        0.5,
        metavar="P",
        help="probability (0 to 1) that a call goes to --cross-model, decided per call",
    )
    consumer: ConsumerSettings = section(ConsumerSettings)

    def __post_init__(self) -> None:
        check_settings(self)


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


def cross_target(config: ConsumerConfig) -> CrossTarget | None:
    """The second model of cross-sampling, when --cross-model names one."""
    return CrossTarget.of(
        config.cross_model, ratio=config.cross_ratio, name=config.cross_model_name
    )


def config_from_args(args: argparse.Namespace) -> tuple[ConsumerConfig, dict]:
    """The settings from defaults, --config, flags and overrides, and where they came from."""
    resolved = resolve(args, KEYS)
    config: ConsumerConfig = resolved.build(ConsumerConfig)
    parse_agent(config.agent, config.env)
    cross_target(config)
    if not normalize_urls(config.llm):
        raise ValueError("no LLM server: pass --llm URL (repeat it for a fleet) or set llm:")
    return config, resolved.describe()


async def consume(args: argparse.Namespace, config: ConsumerConfig, source: dict) -> int:
    nats_settings = settings_from_args(args)
    try:
        name, fn = build_agent(config)
        agent = AgentSpec.of(fn, name)
        reward_fn = load_callable(config.reward, "reward function") if config.reward else None
        model_dir = resolve_model(config.model)
    except (AgentLoadError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cross = cross_target(config)
    spec = ConsumerSpec(
        agent=name,
        fn=fn,
        target=LLMTarget(urls=tuple(normalize_urls(config.llm))),
        cross=cross,
        model_dir=str(model_dir),
        model_name=config.model_name or ("tiny" if config.model == "tiny" else model_dir.name),
        reward_fn=reward_fn,
        settings=config.consumer,
    )
    log.info(
        "consumer config",
        **{
            **settings.flatten(config),
            "llm": list(spec.target.urls),
            "cross_model": list(cross.target.urls) if cross else [],
        },
        **source,
        style=agent.style,
        kind=agent.kind,
        model_dir=str(model_dir),
        nats=nats_settings.redacted(),
    )
    nc = await nats_settings.connect(name=f"agentarium-consumer-{name}")
    metrics = metrics_server(args)
    try:
        service = ConsumerService(nc.jetstream(), Topology(nats_settings.prefix), spec)
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
    add_settings(p, ConsumerConfig)
    add_metrics_flags(p)
    add_config_arguments(p, KEYS)
    add_nats_flags(p)
    p.set_defaults(func=cmd_consumer)
