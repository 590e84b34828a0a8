"""AgentOrchestrator: the seed's integration API, synchronous, over Agentarium's async pipeline.

    orch = AgentOrchestrator(server_addresses=["http://sglang-0:30000"], proxy_port=8123,
                             ray_config={"num_actors": 4}, nats_url="nats://broker:4222")
    orch.register_agent_type("calc", rollout, endpoint=None, model="qwen")
    orch.initialize_batch_processing(data=batch_dict, is_train=True)
    orch.wait_for_batch_completion()
    batch, metrics = orch.generate_training_batch(max_prompt_length=1024,
                                                  max_response_length=2048, device="cuda")
    orch.reset_orchestrator_state()

Every public method blocks the caller and runs on a private event loop (``LoopThread``).
Consumers run in this process by default, as Ray actors with ``ray_config``, or not at all
with ``external_consumers=True`` (``agentarium consumer`` services pull the jobs). Without
``nats_url`` an embedded nats-server is started and stopped with the orchestrator.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from broker import Limits, NatsSettings
from consumers.agents import AgentSpec
from consumers.chat_template import ChatTemplate
from schemas import Sampling, Trajectory, check_name
from trainer import pad_token_id

from .agent_metrics import agent_metrics
from .batch_data import batch_id_for, expand, normalize
from .local_consumers import ConsumerSpec, LLMTarget, normalize_urls
from .loop_thread import LoopThread
from .progress import ProgressBar
from .ray_consumers import RayConfig
from .rollout_core import RolloutCore
from .tensorize import MODES, TrainingBatch, tensorize
from .tiny import resolve_model

log = structlog.get_logger("agentarium.orchestrator")


@dataclass
class BatchState:
    """The batch between ``initialize_batch_processing`` and ``reset_orchestrator_state``."""

    batch_id: str
    is_train: bool
    job_ids: list[str]
    published: int
    duplicates: int
    started: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0
    complete: bool = False


class AgentOrchestrator:
    """Seed-compatible orchestrator; see the module docstring for the loop it serves."""

    def __init__(
        self,
        server_addresses: str | Sequence[str] | None = None,
        proxy_port: int = 0,
        ray_config: RayConfig | Mapping[str, Any] | None = None,
        nats_url: str | None = None,
        *,
        group_size: int = 1,
        val_group_size: int = 1,
        run: str | None = None,
        model: str = "tiny",
        model_name: str | None = None,
        advertise_host: str | None = None,
        proxy_host: str = "0.0.0.0",
        concurrency: int = 64,
        settings: NatsSettings | None = None,
        external_consumers: bool = False,
        default_agent: str | None = None,
        multi_turn: str = "concat",
        sampling: Sampling | Mapping[str, Any] | None = None,
        deadline_s: float = 600.0,
        attempts: int = 3,
        success_threshold: float = 1.0,
        limits: Limits | None = None,
        progress: bool | None = None,
    ) -> None:
        if multi_turn not in MODES:
            raise ValueError(f"multi_turn must be one of {MODES}, got {multi_turn!r}")
        if ray_config is not None and external_consumers:
            raise ValueError(
                "ray_config starts consumer actors; external_consumers=True says "
                "consumers run elsewhere: pass one or the other"
            )
        for name, value in (
            ("group_size", group_size),
            ("val_group_size", val_group_size),
            ("concurrency", concurrency),
        ):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.server_addresses = normalize_urls(server_addresses)
        self.proxy_port = int(proxy_port or 0)
        self.ray_config = (
            RayConfig.of(dict(ray_config) if isinstance(ray_config, Mapping) else ray_config)
            if ray_config is not None
            else None
        )
        self.run = run or f"orch-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        check_name(self.run, "run")
        self.group_size = group_size
        self.val_group_size = val_group_size
        self.model_ref = model
        self.advertise_host = advertise_host
        self.proxy_host = proxy_host
        self.concurrency = concurrency
        self.external_consumers = external_consumers
        self.default_agent = default_agent
        self.multi_turn = multi_turn
        self.sampling = Sampling(**sampling) if isinstance(sampling, Mapping) else sampling
        self.deadline_s = deadline_s
        self.attempts = attempts
        self.success_threshold = success_threshold
        self.progress = progress
        if settings is None and nats_url is not None:
            settings = NatsSettings.from_env(url=nats_url)
        self.model_dir = str(resolve_model(model)) if model else None
        self.model_name = model_name or (
            "tiny" if model == "tiny" else (resolve_model(model).name if model else "model")
        )
        self._template = ChatTemplate.from_model_dir(self.model_dir) if self.model_dir else None
        self.agents: dict[str, AgentSpec | None] = {}
        self.endpoints: dict[str, list[str]] = {}
        self._sequence = 0
        self._batch: BatchState | None = None
        self._loop = LoopThread()
        self._core = RolloutCore(
            settings=settings, run=self.run, limits=limits, ray_config=self.ray_config
        )
        try:
            self._loop.call(self._core.start())
        except BaseException:
            self.close()
            raise
        log.info(
            "orchestrator started",
            run=self.run,
            servers=self.server_addresses,
            nats=self._core.settings.redacted() if self._core.settings else None,
            consumers="external" if external_consumers else ("ray" if self.ray_config else "local"),
            model=self.model_dir,
            group_size=group_size,
        )

    # ---- agents ------------------------------------------------------------------------------
    def register_agent_type(
        self,
        agent_name: str,
        fn: Any = None,
        endpoint: str | Sequence[str] | None = None,
        model: str | None = None,
        *,
        reward_fn: Any = None,
        concurrency: int | None = None,
    ) -> list[str]:
        """Register an agent and start its consumers; returns their proxy base URLs.

        ``fn``: any agent shape (``rollout(task, llm)``, ``rollout(task, endpoint, model)``, a
        Ray remote function). ``endpoint``: where this agent's LLM calls go (default: the
        orchestrator's ``server_addresses``; a URL ending in ``/v1`` is an OpenAI-compatible
        server, for evaluation). ``model``: the model name handed to endpoint-style agents.
        """
        self._check_open()
        check_name(agent_name, "agent")
        if agent_name in self.agents:
            raise ValueError(f"agent {agent_name!r} is already registered")
        if self.external_consumers:
            self.agents[agent_name] = AgentSpec.of(fn, agent_name) if fn is not None else None
            self.endpoints[agent_name] = []
            return []
        if fn is None:
            raise ValueError(
                f"register_agent_type({agent_name!r}) needs the agent function "
                "(or create the orchestrator with external_consumers=True)"
            )
        agent = AgentSpec.of(fn, agent_name)  # refuses an unsupported shape before any start
        model_name = model or self.model_name
        target = LLMTarget.of(endpoint, self.server_addresses, model_name)
        spec = ConsumerSpec(
            agent=agent_name,
            fn=fn,
            target=target,
            model_dir=self.model_dir if target.trainable else None,
            model_name=model_name,
            concurrency=concurrency or self.concurrency,
            proxy_host=self.proxy_host,
            proxy_port=self.proxy_port,
            advertise_host=self.advertise_host,
            attempts=self.attempts,
            reward_fn=reward_fn,
            worker_id=f"{self.run}-{agent_name}",
        )
        if self.ray_config is not None:
            model_ref = self.model_ref if target.trainable else None
            endpoints = self._loop.call(self._core.start_ray(spec, model_ref))
        else:
            template = self._template if target.trainable else None
            endpoints = [self._loop.call(self._core.start_local(spec, template))]
            if self.proxy_port:
                self.proxy_port += 1  # the next agent's proxy starts above this one
        self.agents[agent_name] = agent
        self.endpoints[agent_name] = endpoints
        return endpoints

    # ---- one batch ---------------------------------------------------------------------------
    def initialize_batch_processing(
        self,
        data: Any,
        is_train: bool = True,
        *,
        group_size: int | None = None,
        agent: str | None = None,
        batch_id: str | None = None,
        sampling: Sampling | Mapping[str, Any] | None = None,
        metadata: Mapping[str, Any] | None = None,
        deadline_s: float | None = None,
    ) -> BatchState:
        """Validate ``data``, expand it into jobs (group_size per row) and publish them."""
        self._check_open()
        if self._batch is not None:
            raise RuntimeError(
                f"batch {self._batch.batch_id} is still loaded: call reset_orchestrator_state() "
                "before initialize_batch_processing()"
            )
        default = (
            agent
            or self.default_agent
            or (next(iter(self.agents)) if len(self.agents) == 1 else None)
        )
        rows = normalize(data, registered=self.agents, default_agent=default)
        size = group_size or (self.group_size if is_train else self.val_group_size)
        if batch_id is None:
            batch_id = batch_id_for(self.run, self._sequence, rows, size, is_train)
        else:
            check_name(batch_id, "batch_id")
        if isinstance(sampling, Mapping):
            sampling = Sampling(**sampling)
        jobs = expand(
            rows,
            run=self.run,
            batch_id=batch_id,
            group_size=size,
            is_train=is_train,
            sampling=sampling or self.sampling,
            deadline_s=deadline_s or self.deadline_s,
            metadata=metadata,
        )
        self._progress = ProgressBar(len(jobs), enabled=self.progress)
        published, duplicates = self._loop.call(self._core.submit(jobs, self._progress.update))
        self._sequence += 1
        self._batch = BatchState(
            batch_id, is_train, [j.job_id for j in jobs], published, duplicates
        )
        log.info(
            "batch submitted",
            run=self.run,
            batch_id=batch_id,
            jobs=len(jobs),
            rows=len(rows),
            group_size=size,
            is_train=is_train,
            duplicates=duplicates,
        )
        return self._batch

    def _check_open(self) -> None:
        if not self._loop.running:
            raise RuntimeError("the orchestrator is closed: create a new AgentOrchestrator")

    def _current(self) -> BatchState:
        if self._batch is None:
            raise RuntimeError(
                "no batch is loaded: call initialize_batch_processing(data, is_train) first"
            )
        return self._batch

    def wait_for_batch_completion(self, timeout: float | None = None) -> dict[str, int]:
        """Block until every job of the batch has a trajectory (ok, error or timeout).

        Raises TimeoutError after ``timeout`` seconds, saying how many are missing; what has
        arrived stays available to ``generate_training_batch`` and the metrics.
        """
        batch = self._current()
        started = time.monotonic()
        try:
            self._loop.call(self._core.wait(timeout))
            batch.complete = True
        finally:
            batch.waited_s += time.monotonic() - started
            self._progress.close()
        return self._status_counts()

    def _status_counts(self) -> dict[str, int]:
        counts = {"jobs": len(self._current().job_ids), "ok": 0, "error": 0, "timeout": 0}
        for trajectory in self.trajectories():
            counts[trajectory.status] += 1
        return counts

    def trajectories(self) -> list[Trajectory]:
        """The current batch's trajectories that have arrived, in job order."""
        batch = self._current()
        results = self._core.feed.results
        return [results[j] for j in batch.job_ids if j in results]

    def generate_training_batch(
        self,
        max_prompt_length: int,
        max_response_length: int,
        device: Any = "cpu",
        *,
        multi_turn: str | None = None,
        include_failed: bool = False,
        pad_token_id: int | None = None,
        std_norm: bool = True,
        adv_eps: float = 1e-6,
    ) -> tuple[TrainingBatch, dict[str, float]]:
        """Padded tensors of the batch (see ``agentarium.tensorize``) and its metrics.

        The batch carries the trainer's GRPO ``advantages`` (``std_norm`` as verl's
        ``algorithm.norm_adv_by_std_in_grpo``); when ``meta_info["multi_row_trajectories"]`` is
        not 0, train on them and skip verl's ``compute_advantage`` for this batch.
        """
        batch = self._current()
        trajectories = self.trajectories()
        tensors, counts = tensorize(
            trajectories,
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
            pad_token_id=self.pad_token_id if pad_token_id is None else pad_token_id,
            device=device,
            multi_turn=multi_turn or self.multi_turn,
            include_failed=include_failed,
            std_norm=std_norm,
            adv_eps=adv_eps,
        )
        metrics = agent_metrics(trajectories, success_threshold=self.success_threshold)
        metrics.update(counts)
        metrics["batch/missing"] = float(len(batch.job_ids) - len(trajectories))
        metrics["batch/wait_s"] = batch.waited_s
        tensors.meta_info.update(run=self.run, batch_id=batch.batch_id)
        return tensors, metrics

    def collect_validation_metrics(self) -> dict[str, float]:
        """Per agent and overall: reward mean/std, success rate, pass@k, errors, timeouts,
        turns, tokens, latency percentiles (``agentarium.agent_metrics``)."""
        batch = self._current()
        metrics = agent_metrics(self.trajectories(), success_threshold=self.success_threshold)
        metrics["overall/missing"] = float(len(batch.job_ids) - len(self.trajectories()))
        return metrics

    def reset_orchestrator_state(self) -> None:
        """Forget the current batch; late trajectories of an unfinished one are ignored."""
        self._batch = None
        if self._loop.running:
            self._loop.loop.call_soon_threadsafe(self._core.clear)

    # ---- misc --------------------------------------------------------------------------------
    @property
    def pad_token_id(self) -> int:
        template = self._template
        if template is None:
            return 0
        pad = template.special_tokens.get("pad_token")
        return pad_token_id(
            template.tokenizer.token_to_id(pad) if pad else None, template.eos_token_ids
        )

    @property
    def nats_url(self) -> str:
        return self._core.settings.url if self._core.settings else ""

    def close(self) -> None:
        """Stop consumers (in-process or Ray actors), the feed, the connection and any
        embedded nats-server. Safe to call twice."""
        if self._loop.running:
            try:
                self._loop.call(self._core.close(), timeout=60)
            finally:
                self._loop.stop()

    def __enter__(self) -> AgentOrchestrator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        batch = self._batch
        state = f"batch={batch.batch_id} jobs={len(batch.job_ids)}" if batch else "no batch"
        return f"<AgentOrchestrator run={self.run!r} agents={sorted(self.agents)} {state}>"
