"""``agentarium consumer``: a rollout worker for one agent."""

from __future__ import annotations

import argparse
import sys

import structlog

from broker import Topology
from consumers.agents import AgentLoadError, AgentRunner, AgentSpec, load_callable
from consumers.backends.sglang import SGLangBackend
from consumers.chat_template import ChatTemplate
from consumers.delivery import DeliveryPolicy
from consumers.proxy import TracingProxy
from consumers.rollout import RolloutEnv
from consumers.worker import Worker, WorkerConfig, default_worker_id
from schemas import SchemaError, check_name

from ..tiny import resolve_model
from .common import add_nats_flags, install_stop_handlers, run_async, settings_from_args

log = structlog.get_logger("agentarium.cli")


def parse_agent(value: str) -> tuple[str, str]:
    name, sep, spec = value.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(
            f"--agent {value!r}: write NAME=module:function, e.g. toy=examples.toy:rollout"
        )
    try:
        check_name(name, "agent")
    except SchemaError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return name, spec


async def _consume(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    name, spec = args.agent
    try:
        fn = load_callable(spec, "agent")
        agent = AgentSpec.of(fn, name)
        reward_fn = load_callable(args.reward, "reward function") if args.reward else None
    except AgentLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    model_dir = resolve_model(args.model)
    model_name = args.model_name or ("tiny" if args.model == "tiny" else model_dir.name)
    template = ChatTemplate.from_model_dir(model_dir)
    backend = SGLangBackend(args.llm, retries=args.llm_retries, timeout=args.llm_timeout)
    proxy = TracingProxy(
        host=args.proxy_host, port=args.proxy_port, advertised_host=args.advertise_host
    )
    await proxy.start()
    runner = AgentRunner(agent, model_name=model_name, threads=max(4, min(args.concurrency, 256)))
    env = RolloutEnv(
        runner=runner,
        backend=backend,
        template=template,
        proxy=proxy,
        model_name=model_name,
        worker_id=args.worker_id,
        reward_fn=reward_fn,
    )
    config = WorkerConfig(
        agent=name,
        concurrency=args.concurrency,
        ack_wait_s=args.ack_wait,
        burst=args.burst,
        drain_grace_s=args.drain_grace,
        worker_id=args.worker_id,
        retry=DeliveryPolicy(attempts=args.attempts, base_delay_s=args.retry_delay),
    )
    log.info(
        "consumer config",
        agent=name,
        spec=spec,
        style=agent.style,
        kind=agent.kind,
        llm=args.llm,
        model=str(model_dir),
        concurrency=args.concurrency,
        burst=args.burst,
        proxy=proxy.endpoint_for("JOB"),
        nats=settings.redacted(),
    )
    nc = await settings.connect(name=f"agentarium-consumer-{name}")
    worker = Worker(nc.jetstream(), Topology(settings.prefix), config, env)
    install_stop_handlers(worker.stop)
    try:
        counters = await worker.run()
    finally:
        runner.close()
        await proxy.stop()
        await backend.aclose()
        await nc.close()
    print(f"worker {config.worker_id}: {vars(counters)}", file=sys.stderr)
    return 0


def cmd_consumer(args: argparse.Namespace) -> int:
    return run_async(lambda: _consume(args), service=f"agentarium-consumer-{args.agent[0]}")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "consumer",
        help="run a rollout worker for one agent",
        description="Pull jobs for one agent from JetStream, run the agent with a tracing LLM client, and store "
        "one trajectory per job. Any number of consumers may run on the same agent and share its queue. "
        "SIGTERM drains: no new jobs, in-flight ones finish within --drain-grace, the rest are released.",
    )
    p.add_argument(
        "--agent",
        required=True,
        type=parse_agent,
        metavar="NAME=module:function",
        help="agent name and its rollout function, e.g. toy=examples.toy:rollout. The function is "
        "rollout(task, llm) (async or not) or rollout(task, endpoint, model), or a Ray remote function",
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
        help="runs of a failing job before it is dead-lettered (default %(default)s)",
    )
    p.add_argument(
        "--retry-delay",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="first retry delay; doubles per attempt, capped at 60 s (default %(default)s)",
    )
    p.add_argument(
        "--ack-wait",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="redelivery timeout; in-flight jobs are heartbeated every third of it (default %(default)s)",
    )
    p.add_argument(
        "--drain-grace",
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
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="per LLM request (default %(default)s)",
    )
    p.add_argument(
        "--proxy-host",
        default="0.0.0.0",
        help="bind address of the OpenAI-compatible tracing proxy (default %(default)s)",
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
        help="host name put in the per-rollout endpoint URLs, for agents on other machines (default: this host)",
    )
    p.add_argument(
        "--worker-id",
        default=default_worker_id(),
        help="name in the workers registry (default: host-pid-random)",
    )
    add_nats_flags(p)
    p.set_defaults(func=cmd_consumer)
