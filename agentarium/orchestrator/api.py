"""AgentOrchestrator: the seed's integration API, synchronous, over Agentarium's async pipeline.

    orch = AgentOrchestrator(server_addresses=["http://sglang-0:30000"], proxy_port=8123,
                             ray_config={"num_actors": 4}, nats_url="nats://broker:4222")
    orch.register_agent_type("calc", rollout, endpoint=None, model="qwen")
    orch.register_agent_type("db", env="sql")   # the generic agent on `agentarium env serve sql`
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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from broker import NatsSettings, tune_gc
from consumers import AgentSpec, ChatTemplate, ConsumerSettings, ConsumerSpec, LLMTarget, env_agent
from schemas import Sampling, Trajectory, check_name
from trainer import pad_token_id

from ..agent_metrics import agent_metrics
from ..progress import ProgressBar
from ..tiny import resolve_model
from .batch_data import batch_id_for, expand, normalize
from .config import OrchestratorConfig
from .core import RolloutCore
from .loop_thread import LoopThread
from .ray_consumers import RayConfig
from .tensorize import TrainingBatch, tensorize

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
    """Seed-compatible orchestrator; see the module docstring for the loop it serves.

    The constructor only validates (into a frozen ``OrchestratorConfig``) and loads the
    tokenizer: the event loop thread, the broker connection (or embedded nats-server) start
    on first use, or on ``start()``.
    """

    def __init__(
        self,
        server_addresses: str | Sequence[str] | None = None,
        proxy_port: int = 0,
        ray_config: RayConfig | Mapping[str, Any] | None = None,
        nats_url: str | None = None,
        *,
        config: OrchestratorConfig | None = None,
        settings: NatsSettings | None = None,
        **options: Any,
    ) -> None:
        if config is None:
            config = OrchestratorConfig.of(
                server_addresses=server_addresses,
                proxy_port=proxy_port,
                ray_config=ray_config,
                nats_url=nats_url,
                **options,
            )
        elif server_addresses or proxy_port or ray_config or nats_url or options:
            raise ValueError("pass either config= or the individual options, not both")
        self.config = config
        if settings is None and config.nats_url is not None:
            settings = NatsSettings.from_env(url=config.nats_url)
        self.run = config.run
        self.progress = config.progress  # a display switch, not a setting: may be flipped
        self.model_dir = str(resolve_model(config.model)) if config.model else None
        self.model_name = config.model_name or (
            "tiny"
            if config.model == "tiny"
            else (Path(self.model_dir).name if self.model_dir else "model")
        )
        self._template = ChatTemplate.from_model_dir(self.model_dir) if self.model_dir else None
        self._next_proxy_port = config.proxy_port
        self.agents: dict[str, AgentSpec | None] = {}
        self.endpoints: dict[str, list[str]] = {}
        self._sequence = 0
        self._batch: BatchState | None = None
        self._loop: LoopThread | None = None
        self._closed = False
        self._core = RolloutCore(
            settings=settings, run=self.run, limits=config.limits, ray_config=config.ray_config
        )

    def start(self) -> AgentOrchestrator:
        """Start the event loop thread and connect (or start an embedded nats-server).
        Called by the first method that needs it; calling it again does nothing."""
        self._check_open()
        if self._loop is not None:
            return self
        self._loop = LoopThread()
        try:
            self._loop.call(self._core.start())
        except BaseException:
            self.close()
            raise
        # The young generation's threshold only (broker/gc_tuning.py): with torch imported, a
        # full collection every ~70,000 allocations was a sixth of the rollout layer's CPU.
        tune_gc(freeze=False)
        cfg = self.config
        log.info(
            "orchestrator started",
            run=self.run,
            servers=list(cfg.server_addresses),
            nats=self._core.settings.redacted() if self._core.settings else None,
            consumers="external"
            if cfg.external_consumers
            else ("ray" if cfg.ray_config else "local"),
            model=self.model_dir,
            group_size=cfg.group_size,
        )
        return self

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the orchestrator is closed: create a new AgentOrchestrator")

    @property
    def _running(self) -> LoopThread:
        self.start()
        assert self._loop is not None
        return self._loop

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
        env: str | None = None,
        max_turns: int | None = None,
    ) -> list[str]:
        """Register an agent and start its consumers; returns their proxy base URLs.

        ``fn``: any agent shape (``rollout(task, llm)``, ``rollout(task, endpoint, model)``, a
        Ray remote function). ``endpoint``: where this agent's LLM calls go (default: the
        orchestrator's ``server_addresses``; a URL ending in ``/v1`` is an OpenAI-compatible
        server, for evaluation). ``model``: the model name handed to endpoint-style agents.
        ``env`` instead of ``fn``: the generic function-call agent on that environment service
        (``agentarium env serve ENV``), at most ``max_turns`` model calls per rollout (None: the
        agent's default, 10); each row of a batch is the environment's task.
        """
        self._check_open()
        check_name(agent_name, "agent")
        if agent_name in self.agents:
            raise ValueError(f"agent {agent_name!r} is already registered")
        if env is not None:
            if fn is not None:
                raise ValueError(
                    f"register_agent_type({agent_name!r}): pass fn (your agent) or env (the "
                    "generic function-call agent on that environment), not both"
                )
            fn = env_agent(env) if max_turns is None else env_agent(env, max_turns=max_turns)
        cfg = self.config
        if cfg.external_consumers:
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
        target = LLMTarget.of(endpoint, cfg.server_addresses, model_name)
        spec = ConsumerSpec(
            agent=agent_name,
            fn=fn,
            target=target,
            model_dir=self.model_dir if target.trainable else None,
            model_name=model_name,
            reward_fn=reward_fn,
            settings=ConsumerSettings.of(
                **{
                    **({"concurrency": c} if (c := concurrency or cfg.concurrency) else {}),
                    "proxy_host": cfg.proxy_host,
                    "proxy_port": self._next_proxy_port,
                    "advertise_host": cfg.advertise_host,
                    "attempts": cfg.attempts,
                    "worker_id": f"{self.run}-{agent_name}",
                },
            ),
        )
        if cfg.ray_config is not None:
            model_ref = cfg.model if target.trainable else None
            endpoints = self._running.call(self._core.start_ray(spec, model_ref))
        else:
            template = self._template if target.trainable else None
            endpoints = [self._running.call(self._core.start_local(spec, template))]
            if self._next_proxy_port:
                self._next_proxy_port += 1  # the next agent's proxy starts above this one
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
        cfg = self.config
        default = (
            agent
            or cfg.default_agent
            or (next(iter(self.agents)) if len(self.agents) == 1 else None)
        )
        rows = normalize(data, registered=self.agents, default_agent=default)
        size = group_size or (cfg.group_size if is_train else cfg.val_group_size)
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
            sampling=sampling or cfg.sampling,
            deadline_s=deadline_s or cfg.deadline_s,
            metadata=metadata,
        )
        self._progress = ProgressBar(len(jobs), enabled=self.progress)
        published, duplicates = self._running.call(self._core.submit(jobs, self._progress.update))
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
            self._running.call(self._core.wait(timeout))
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
            multi_turn=multi_turn or self.config.multi_turn,
            include_failed=include_failed,
            std_norm=std_norm,
            adv_eps=adv_eps,
        )
        metrics = agent_metrics(trajectories, success_threshold=self.config.success_threshold)
        metrics.update(counts)
        metrics["batch/missing"] = float(len(batch.job_ids) - len(trajectories))
        metrics["batch/wait_s"] = batch.waited_s
        tensors.meta_info.update(run=self.run, batch_id=batch.batch_id)
        return tensors, metrics

    def collect_validation_metrics(self) -> dict[str, float]:
        """Per agent and overall: reward mean/std, success rate, pass@k, errors, timeouts,
        turns, tokens, latency percentiles (``agentarium.agent_metrics``)."""
        batch = self._current()
        metrics = agent_metrics(
            self.trajectories(), success_threshold=self.config.success_threshold
        )
        metrics["overall/missing"] = float(len(batch.job_ids) - len(self.trajectories()))
        return metrics

    def reset_orchestrator_state(self) -> None:
        """Forget the current batch; late trajectories of an unfinished one are ignored."""
        self._batch = None
        if self._loop is not None and self._loop.running:
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
        self._closed = True
        if self._loop is not None and self._loop.running:
            try:
                self._loop.call(self._core.close(), timeout=60)
            finally:
                self._loop.stop()

    def __enter__(self) -> AgentOrchestrator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        batch = self._batch
        state = f"batch={batch.batch_id} jobs={len(batch.job_ids)}" if batch else "no batch"
        return f"<AgentOrchestrator run={self.run!r} agents={sorted(self.agents)} {state}>"
