"""The consumer service: one rollout worker with its tracing proxy, LLM backend and agent runner.

The one place a consumer is assembled. ``agentarium consumer`` runs one as a process, the
orchestrator and ``eval run`` run them on their own event loop (or inside Ray actors), and the
demo starts the command. ``LLMTarget`` says where an agent's LLM calls go: SGLang-compatible
servers (token ids, trainable) or an OpenAI-compatible ``/v1`` endpoint (text only, for
evaluation).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from nats.js import JetStreamContext

from agentarium.broker import Topology, cancel_and_wait, loop_name, watch_lag
from agentarium.formats import ChatTemplate
from agentarium.schemas import SettingError

from .agents.envclient import EnvClient
from .agents.loading import AgentRunner, AgentSpec
from .backends import CrossSamplingBackend, OpenAICompatBackend, SGLangBackend, VLLMBackend
from .backends.cross_sampling import check_same_tokenizer
from .backends.engine_holds import watch_engine_records
from .backends.vocab import check_engine_tokenizer
from .config import ConsumerSettings
from .errors import CrossSamplingError
from .fleet import Fleet, supports
from .metrics import LOOP_LAG_SECONDS
from .rollout import RolloutEnv
from .tracing.proxy import TracingProxy
from .worker.counters import Counters
from .worker.worker import Worker

log = structlog.get_logger("agentarium.consumers")

PORT_SCAN = 64  # ports tried upwards from a base port before giving up

# One event-loop lag watcher per loop, however many consumers share it: [task, users].
_lag_watchers: dict[asyncio.AbstractEventLoop, list] = {}


def _watch_lag() -> None:
    loop = asyncio.get_running_loop()
    entry = _lag_watchers.get(loop)
    if entry is None or entry[0].done():
        entry = _lag_watchers[loop] = [loop.create_task(watch_lag(LOOP_LAG_SECONDS.observe)), 0]
    entry[1] += 1


def _unwatch_lag() -> None:
    loop = asyncio.get_running_loop()
    entry = _lag_watchers.get(loop)
    if entry is not None:
        entry[1] -= 1
        if entry[1] <= 0:
            entry[0].cancel()
            del _lag_watchers[loop]


def normalize_urls(urls: str | Sequence[str] | None) -> list[str]:
    """``host:port`` gets ``http://``; trailing slashes go; a comma-separated string splits."""
    if urls is None:
        return []
    if isinstance(urls, str):
        urls = [u for u in urls.split(",") if u.strip()]
    out = []
    for url in urls:
        url = str(url).strip().rstrip("/")
        out.append(url if "://" in url else f"http://{url}")
    return out


@dataclass(frozen=True, kw_only=True)
class LLMTarget:
    """Where an agent's LLM calls go. ``openai_base`` (a URL ending in /v1) wins over ``urls``."""

    urls: tuple[str, ...] = ()
    openai_base: str = ""
    openai_model: str = ""
    api_key: str | None = None
    lora: str | None = None  # the LoRA adapter SGLang-compatible servers answer with
    engine: str = "sglang"  # what the urls serve: sglang (or the local engine), or vllm

    @classmethod
    def of(
        cls, endpoint: str | Sequence[str] | None, default_urls: Sequence[str], model: str
    ) -> LLMTarget:
        urls = normalize_urls(endpoint) or list(default_urls)
        if len(urls) == 1 and urls[0].endswith("/v1"):
            return cls(openai_base=urls[0], openai_model=model)
        if not urls:
            raise ValueError(
                "no LLM server for this agent: pass server_addresses to AgentOrchestrator, or an "
                "endpoint (SGLang URL, or an OpenAI-compatible base URL ending in /v1) to "
                "register_agent_type"
            )
        return cls(urls=tuple(urls))

    @property
    def trainable(self) -> bool:
        return not self.openai_base

    def backend(
        self, *, retries: int = 3, timeout: float = 600.0, template: ChatTemplate | None = None
    ) -> Any:
        """The backend for these servers; a vLLM fleet's needs the consumer's ``template``
        (its replies' text is decoded here)."""
        if self.openai_base:
            return OpenAICompatBackend(
                self.openai_base, self.openai_model, self.api_key, retries=retries, timeout=timeout
            )
        urls = list(self.urls)
        if self.engine == "vllm":
            if template is None:
                raise ValueError("a vLLM fleet needs the model's chat template: pass --model")
            return VLLMBackend(
                urls, decode=template.decode, retries=retries, timeout=timeout, lora=self.lora
            )
        return SGLangBackend(urls, retries=retries, timeout=timeout, lora=self.lora)


@dataclass(frozen=True, kw_only=True)
class CrossTarget:
    """Cross-sampling: a second model serving each call with probability ``ratio``
    (``CrossSamplingBackend``). Its calls are recorded with ``policy`` false and its ``name``;
    with SGLang-compatible targets it must share the policy's tokenizer (checked at start)."""

    target: LLMTarget
    ratio: float
    name: str = "cross"
    seed: int | None = None  # of the per-call coin; None: a fresh one

    def __post_init__(self) -> None:
        _check_ratio(self.ratio)


def _check_ratio(ratio: float) -> None:
    # a CrossTarget made in code; the commands' ratio is checked as it is read (RolloutSettings)
    if not 0.0 <= ratio <= 1.0:
        raise SettingError(f"--cross-ratio must be in [0, 1], got {ratio}")


@dataclass(frozen=True, kw_only=True)
class ConsumerSpec:
    """Everything one consumer needs; picklable, so a Ray actor can be handed one."""

    agent: str
    fn: Any
    target: LLMTarget
    model_dir: str | None  # tokenizer + chat template; None for OpenAI-compatible targets
    model_name: str
    reward_fn: Any = None
    cross: CrossTarget | None = None  # cross-sampling: some calls go to a second model
    settings: ConsumerSettings = field(default_factory=ConsumerSettings)


LOOPBACK_NAMES = ("localhost", "::1")


def proxy_bind_host(proxy_host: str | None, advertise_host: str | None, agent: AgentSpec) -> str:
    """Where the tracing proxy listens when ``proxy_host`` is not given: loopback (agents on
    this machine), unless agents may call from elsewhere: all interfaces when an advertised
    host other than loopback says where they reach us, and for a Ray remote function agent
    (its tasks run anywhere in the Ray cluster) the address Ray knows this node by."""
    if proxy_host:
        return proxy_host
    if advertise_host:
        loopback = advertise_host.startswith("127.") or advertise_host in LOOPBACK_NAMES
        return "127.0.0.1" if loopback else "0.0.0.0"
    if agent.kind == "ray":
        import ray

        return str(ray.util.get_node_ip_address())
    return "127.0.0.1"


async def start_proxy(host: str, base_port: int, advertise_host: str | None) -> TracingProxy:
    """A tracing proxy on ``base_port`` or the first free port above it (0: any free port), so
    several consumers on one node, each starting from its own offset, never collide."""
    if not base_port:
        proxy = TracingProxy(host=host, port=0, advertised_host=advertise_host)
        await proxy.start()
        return proxy
    last: OSError | None = None
    for port in range(base_port, base_port + PORT_SCAN):
        proxy = TracingProxy(host=host, port=port, advertised_host=advertise_host)
        try:
            await proxy.start()
            return proxy
        except OSError as exc:
            last = exc
            await proxy.close()
    raise OSError(
        f"no free port for the tracing proxy in {base_port}..{base_port + PORT_SCAN - 1} on "
        f"{host} ({last}): pass another proxy_port, or 0 for any free port"
    )


class ConsumerService:
    """One running worker: ``await start()`` returns once it pulls, ``await stop()`` drains it,
    ``await wait()`` returns its counters when it stops by itself (burst mode, or ``stop()``)."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        spec: ConsumerSpec,
        *,
        template: ChatTemplate | None = None,
        backend: Any = None,
    ) -> None:
        self.js = js
        self.topology = topology
        self.spec = spec
        self._template = template
        self.proxy: TracingProxy | None = None
        self.worker: Worker | None = None
        self._backend: Any = backend  # None: built from spec.target
        self._runner: AgentRunner | None = None
        self._task: asyncio.Task[Counters] | None = None
        self._watching_lag = False
        self.fleets: tuple[Fleet, ...] = ()
        self._holds: asyncio.Task | None = None  # engines KV watch: backends/engine_holds.py

    def __repr__(self) -> str:
        return f"<ConsumerService {self.spec.agent} {self.worker!r}>"

    @property
    def endpoint_base(self) -> str:
        return self.proxy.base_url if self.proxy else ""

    async def start(self) -> ConsumerService:
        spec = self.spec
        template = self._template
        if template is None and spec.model_dir is not None:
            template = ChatTemplate.from_model_dir(
                Path(spec.model_dir), tool_fallback=spec.settings.tool_fallback
            )
        if template is None and spec.target.trainable:
            raise ValueError(
                f"agent {spec.agent!r}: SGLang servers take token ids, so the model's tokenizer is "
                "needed: pass model='tiny', 'smol' or a model directory"
            )
        agent = AgentSpec.of(spec.fn, spec.agent)
        if self._backend is None:
            self._backend = await self._build_backend(template)
        elif spec.cross is not None:
            raise ValueError("pass either a backend or spec.cross (which builds one), not both")
        elif supports(self._backend):
            self._backend = self._fleet(self._backend, "llm")
        for fleet in self.fleets:
            await fleet.start()
        if self.fleets:
            self._holds = asyncio.create_task(
                watch_engine_records(self.js, self.topology, self.fleets), name="engine-holds"
            )
        try:
            host = proxy_bind_host(spec.settings.proxy_host, spec.settings.advertise_host, agent)
            self.proxy = await start_proxy(
                host, spec.settings.proxy_port, spec.settings.advertise_host
            )
        except BaseException:
            await self._close()
            raise
        self._runner = AgentRunner(
            agent, model_name=spec.model_name, threads=max(4, min(spec.settings.concurrency, 256))
        )
        env = RolloutEnv(
            runner=self._runner,
            backend=self._backend,
            template=template,
            proxy=self.proxy,
            model_name=spec.model_name,
            worker_id=spec.settings.worker_id,
            reward_fn=spec.reward_fn,
            fleets=self.fleets,
            # nats-py keeps no public handle on a context's connection
            envs=EnvClient(self.js._nc, self.topology) if agent.envs else None,
        )
        self.worker = Worker(self.js, self.topology, spec.agent, spec.settings, env)
        self._task = asyncio.create_task(self.worker.run(), name=f"worker-{spec.agent}")
        _watch_lag()  # agentarium_event_loop_lag_seconds
        self._watching_lag = True
        log.info(
            "consumer started",
            agent=spec.agent,
            style=agent.style,
            kind=agent.kind,
            proxy=self.proxy.base_url,
            worker_id=spec.settings.worker_id,
            concurrency=spec.settings.concurrency,
            burst=spec.settings.burst,
            loop=loop_name(),
        )
        return self

    async def _build_backend(self, template: ChatTemplate | None) -> Any:
        """The target's backend, once its servers are known to read the token ids this
        consumer renders (``check_engine_tokenizer``), wrapped for cross-sampling when
        ``spec.cross`` is set, once the second model is known to take the policy's ids."""
        spec = self.spec
        primary = spec.target.backend(
            retries=spec.settings.llm_retries,
            timeout=spec.settings.llm_timeout_s,
            template=template,
        )
        if spec.cross is None:
            await self._check_tokenizer(template, primary)
            return self._fleet(primary, "llm")
        cross = spec.cross
        secondary = cross.target.backend(
            retries=spec.settings.llm_retries,
            timeout=spec.settings.llm_timeout_s,
            template=template,
        )
        try:
            if cross.target.trainable != spec.target.trainable:
                raise CrossSamplingError(
                    "cross-sampling needs both models behind the same kind of API: SGLang "
                    "servers (token ids) or OpenAI-compatible endpoints (text), not one of each"
                )
            if spec.target.trainable:
                await check_same_tokenizer(
                    primary,
                    secondary,
                    policy_name=spec.model_name,
                    cross_name=cross.name,
                    policy_tokenizer=spec.model_dir or "",
                )
            await self._check_tokenizer(template)
        except BaseException:
            await primary.aclose()
            await secondary.aclose()
            raise
        log.info(
            "cross-sampling",
            agent=spec.agent,
            policy=spec.model_name,
            cross_model=cross.name,
            cross_ratio=cross.ratio,
            cross_urls=list(cross.target.urls) or [cross.target.openai_base],
        )
        return CrossSamplingBackend(
            self._fleet(primary, "llm"),
            self._fleet(secondary, cross.name),
            cross.ratio,
            primary_name=spec.model_name,
            secondary_name=cross.name,
            seed=cross.seed,
        )

    async def _check_tokenizer(self, template: ChatTemplate | None, primary: Any = None) -> None:
        """Refuse policy servers that read another vocabulary than ``template`` renders in
        (``TokenizerMismatch``, naming both models); closes ``primary`` when it refuses."""
        spec = self.spec
        if template is None or not spec.target.urls:
            return
        try:
            await check_engine_tokenizer(
                spec.target.urls,
                template,
                model_name=spec.model_name,
                model_dir=spec.model_dir or template.name,
                timeout_s=spec.settings.fleet.probe_timeout_s,
            )
        except BaseException:
            if primary is not None:
                await primary.aclose()
            raise

    def _fleet(self, backend: Any, name: str) -> Fleet:
        """``backend`` watched as one LLM fleet of this agent (started with the service)."""
        fleet = Fleet(backend, agent=self.spec.agent, name=name, policy=self.spec.settings.fleet)
        self.fleets = (*self.fleets, fleet)
        return fleet

    @property
    def ready(self) -> bool:
        """Pulling jobs: bound to the agent's consumer, not draining (what /readyz reports)."""
        return self.worker is not None and self.worker.ready and self.failed is None

    @property
    def failed(self) -> BaseException | None:
        """The worker's crash, if it stopped by itself."""
        if self._task is not None and self._task.done() and not self._task.cancelled():
            return self._task.exception()
        return None

    def drain(self) -> None:
        """Begin draining (what SIGTERM does); ``wait()`` or ``stop()`` returns when done."""
        if self.worker is not None:
            self.worker.stop()

    async def wait(self) -> Counters:
        """Until the worker stops by itself (burst mode, or after ``drain()``); then closes."""
        assert self._task is not None, "start() first"
        try:
            return await self._task
        finally:
            await self._close()

    async def stop(self) -> Counters | None:
        """Drain, wait at most the drain grace (plus a margin), close; never raises."""
        counters = None
        if self.worker is not None and self._task is not None:
            self.worker.stop()
            try:
                counters = await asyncio.wait_for(
                    asyncio.shield(self._task), self.spec.settings.drain_grace_s + 5
                )
            except (TimeoutError, Exception):  # noqa: BLE001 - stopping: report, do not raise
                self._task.cancel()
                with contextlib.suppress(BaseException):
                    await self._task
        await self._close()
        return counters

    async def _close(self) -> None:
        if self._holds is not None:
            # Its KV watch waits with 3.11's wait_for, which swallows a cancel that meets an
            # update (broker/aio.py): cancelled once, a drained consumer waited on it forever
            # when the syncer recorded the engine as a Ctrl-C stopped them all.
            await cancel_and_wait([self._holds])
            with contextlib.suppress(BaseException):
                self._holds.result()
            self._holds = None
        if self._watching_lag:
            self._watching_lag = False
            _unwatch_lag()
        if self._runner is not None:
            self._runner.close()
            self._runner = None
        if self.proxy is not None:
            await self.proxy.close()
            self.proxy = None
        if self._backend is not None:
            await self._backend.aclose()  # a Fleet closes its probes and the backend it wraps
            self._backend = None
            self.fleets = ()
