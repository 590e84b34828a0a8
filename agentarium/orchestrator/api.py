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

The class is the face only; each concept is its own object: ``Runtime`` (the event loop
and the core's start and close), ``AgentRegistry`` (agents and their consumers), ``Batches``
(one batch's jobs, waiting and trajectories), ``results`` (tensors and metrics), with the
settings in ``OrchestratorConfig`` and the model in ``PolicyModel``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import structlog

from agentarium.broker import NatsSettings
from agentarium.consumers import AgentSpec
from agentarium.schemas import Sampling, Trajectory

from . import results
from .agents import AgentRegistry
from .batches import Batches, BatchState
from .config import OrchestratorConfig
from .core import RolloutCore
from .model import PolicyModel
from .ray_consumers import RayConfig
from .runtime import Runtime
from .tensorize import TrainingBatch

log = structlog.get_logger("agentarium.orchestrator")


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
        self._model = PolicyModel.load(
            config.model, config.model_name, tool_fallback=config.consumer.tool_fallback
        )
        self._runtime = Runtime(
            RolloutCore(
                settings=settings, run=self.run, limits=config.limits, ray_config=config.ray_config
            )
        )
        self._agents = AgentRegistry(config, self._model, self._runtime)
        self._batches = Batches(config, self._runtime)

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> AgentOrchestrator:
        """Start the event loop thread and connect (or start an embedded nats-server).
        Called by the first method that needs it; calling it again does nothing."""
        if self._runtime.start():
            cfg, core = self.config, self._runtime.core
            log.info(
                "orchestrator started",
                run=self.run,
                servers=list(cfg.server_addresses),
                nats=core.settings.redacted() if core.settings else None,
                consumers="external"
                if cfg.external_consumers
                else ("ray" if cfg.ray_config else "local"),
                model=self._model.dir,
                group_size=cfg.group_size,
            )
        return self

    def close(self) -> None:
        """Stop consumers (in-process or Ray actors), the feed, the connection and any
        embedded nats-server. Safe to call twice."""
        self._runtime.close()

    def __enter__(self) -> AgentOrchestrator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

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
        Ray remote function), or its spec as a string: ``"module:function"``, or
        ``"exec:CMD"``, a program agent (``program_agent(CMD, scorer=...)`` for its settings). ``endpoint``: where this agent's LLM calls go (default: the
        orchestrator's ``server_addresses``; a URL ending in ``/v1`` is an OpenAI-compatible
        server, for evaluation). ``model``: the model name handed to endpoint-style agents.
        ``env`` instead of ``fn``: the generic function-call agent on that environment service
        (``agentarium env serve ENV``), at most ``max_turns`` model calls per rollout (None: the
        agent's default, 10); each row of a batch is the environment's task.
        """
        self._runtime.check_open()
        return self._agents.register(
            agent_name,
            fn,
            endpoint,
            model,
            reward_fn=reward_fn,
            concurrency=concurrency,
            env=env,
            max_turns=max_turns,
        )

    @property
    def agents(self) -> dict[str, AgentSpec | None]:
        return self._agents.agents

    @property
    def endpoints(self) -> dict[str, list[str]]:
        return self._agents.endpoints

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
        self._runtime.check_open()
        return self._batches.submit(
            data,
            is_train,
            agents=self.agents,
            agent=agent,
            group_size=group_size,
            batch_id=batch_id,
            sampling=sampling,
            metadata=metadata,
            deadline_s=deadline_s,
            progress=self.progress,
        )

    def wait_for_batch_completion(self, timeout: float | None = None) -> dict[str, int]:
        """Block until every job of the batch has a trajectory (ok, error or timeout).

        Raises TimeoutError after ``timeout`` seconds, saying how many are missing; what has
        arrived stays available to ``generate_training_batch`` and the metrics.
        """
        return self._batches.wait(timeout)

    def trajectories(self) -> list[Trajectory]:
        """The current batch's trajectories that have arrived, in job order."""
        return self._batches.trajectories()

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
        return results.training_batch(
            self._batches.current,
            self.trajectories(),
            run=self.run,
            success_threshold=self.config.success_threshold,
            max_prompt_length=max_prompt_length,
            max_response_length=max_response_length,
            pad_token_id=self.pad_token_id if pad_token_id is None else pad_token_id,
            device=device,
            multi_turn=multi_turn or self.config.multi_turn,
            include_failed=include_failed,
            std_norm=std_norm,
            adv_eps=adv_eps,
        )

    def collect_validation_metrics(self) -> dict[str, float]:
        """Per agent and overall: reward mean/std, success rate, pass@k, errors, timeouts,
        turns, tokens, latency percentiles (``agentarium.agent_metrics``)."""
        return results.validation_metrics(
            self._batches.current,
            self.trajectories(),
            success_threshold=self.config.success_threshold,
        )

    def reset_orchestrator_state(self) -> None:
        """Forget the current batch; late trajectories of an unfinished one are ignored."""
        self._batches.reset()

    # ---- misc --------------------------------------------------------------------------------
    @property
    def model_dir(self) -> str | None:
        return self._model.dir

    @property
    def model_name(self) -> str:
        return self._model.name

    @property
    def pad_token_id(self) -> int:
        return self._model.pad_token_id

    @property
    def nats_url(self) -> str:
        settings = self._runtime.core.settings
        return settings.url if settings else ""

    def __repr__(self) -> str:
        batch = self._batches.loaded
        state = f"batch={batch.batch_id} jobs={len(batch.job_ids)}" if batch else "no batch"
        return f"<AgentOrchestrator run={self.run!r} agents={sorted(self.agents)} {state}>"
