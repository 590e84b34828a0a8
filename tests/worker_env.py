"""Building an in-process rollout worker for tests: real NATS, real worker loop, with the
LLM fleet being either the real local engine or a fake that follows SGLang's shapes; and
``dead_letters``, which reads back the dead letters workers published (the dead stream)."""

from __future__ import annotations

from contextlib import asynccontextmanager
from functools import lru_cache

from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from agentarium.broker import Topology
from agentarium.consumers import ConsumerSettings
from agentarium.consumers.agents.loading import AgentRunner, AgentSpec
from agentarium.consumers.backends.sglang import SGLangBackend
from agentarium.consumers.rollout import RolloutEnv
from agentarium.consumers.tracing.proxy import TracingProxy
from agentarium.consumers.worker.worker import Worker
from agentarium.formats.chat_template import ChatTemplate
from agentarium.schemas import DeadLetter, decode


@lru_cache(maxsize=1)
def tiny_template() -> ChatTemplate:
    from agentarium.tiny import ensure_tiny_model

    return ChatTemplate.from_model_dir(ensure_tiny_model())


@asynccontextmanager
async def worker_for(
    js,
    agent_name,
    agent_fn,
    llm_urls,
    *,
    topology=None,
    burst=True,
    concurrency=8,
    attempts=3,
    retry_delay=0.05,
    ack_wait=30.0,
    reward_fn=None,
    worker_id=None,
    limits=None,
    template=None,
    model_name="tiny",
    encoding="msgpack",
    drain_grace=30.0,
):
    """A worker running ``agent_fn`` as ``agent_name`` against ``llm_urls``, rendering chats
    with ``template`` (default the tiny model's) for the model served as ``model_name``."""
    backend = SGLangBackend(list(llm_urls), retries=1, backoff=0.01, max_backoff=0.05)
    proxy = TracingProxy(host="127.0.0.1", port=0, advertised_host="127.0.0.1")
    await proxy.start()
    runner = AgentRunner(AgentSpec.of(agent_fn, agent_name), model_name=model_name, threads=8)
    env = RolloutEnv(
        runner=runner,
        backend=backend,
        template=template or tiny_template(),
        proxy=proxy,
        model_name=model_name,
        worker_id=worker_id or f"test-{agent_name}",
        reward_fn=reward_fn,
    )
    config = ConsumerSettings.of(
        concurrency=concurrency,
        burst=burst,
        ack_wait_s=ack_wait,
        fetch_timeout_s=0.3,
        worker_id=worker_id or f"test-{agent_name}",
        attempts=attempts,
        retry_delay_s=retry_delay,
        retry_max_delay_s=retry_delay * 4,
        encoding=encoding,
        drain_grace_s=drain_grace,
    )
    worker = Worker(js, topology or Topology(), agent_name, config, env, limits=limits)
    try:
        yield worker
    finally:
        runner.close()
        await proxy.stop()
        await backend.aclose()


async def dead_letters(js, topology) -> list[DeadLetter]:
    info = await js.stream_info(topology.dead_stream)
    if not info.state.messages:
        return []
    sub = await js.pull_subscribe(
        f"{topology.prefix}.dead.>",
        durable=None,
        stream=topology.dead_stream,
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL),
    )
    msgs = await sub.fetch(info.state.messages, timeout=5)
    await sub.unsubscribe()
    return [decode(DeadLetter, m.data) for m in msgs]
