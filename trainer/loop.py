"""The Trainer: asynchronous GRPO as one loop.

    while steps remain:
        groups  = await collector.take(B)            # oldest complete groups, staleness applied
        batch   = collate(build_rows(samples))       # (B, T) tensors, loss on model tokens only
        stats   = updater.step(batch, seed(step))    # forward, GRPO loss, backward, clip, AdamW
        report(row)                                  # CSV, trackers, /metrics, <p>.metrics.<run>
        publishing.due(step):  version += 1; await publisher.publish(model, version, step)
        checkpoints.due(step): checkpoint, then ack the groups it covers (no directory: ack)
        with sync_rollouts:    await every engine serving `version` (inference.wait_served)

Setup and teardown are ``_session()``, a context manager around the loop; a missing publisher
or checkpoint directory is a do-nothing object (trainer/publishing.py, trainer/checkpoint.py),
and a step's metrics, span and log line are built in trainer/step_report.py.

The algorithm and its departures from textbook GRPO are in trainer/grpo.py; grouping,
dedup and staleness rules in trainer/groups.py; delivery in trainer/collector.py.

Generation never waits for training: the collector keeps pulling while a step runs (the
update runs in a worker thread), and staleness is measured in published versions. The one
exception is ``sync_rollouts``, the synchronous baseline: only trajectories of the current
version are trained (max staleness 0), and after each publish the loop waits until the engines
serve the new version; the producer releases the next batch on the same signal, so generation
and training alternate.
Trajectories are acked only once a checkpoint covers the step that used them, so a trainer
killed at any moment and restarted with ``resume=True`` trains every ok trajectory exactly
once. Without a checkpoint directory nothing can be resumed, and groups are acked right after
their step. ``stop()`` (SIGTERM) finishes the current step, checkpoints and returns.

The per-step seed is derived from (seed, step), so a resumed run draws what the killed one
would have drawn.

Several agents (tasks) train one policy: one durable consumer and group buffer per agent,
each step's groups composed across them by ``--task-mix`` with a bounded wait for a short task
(trainer/tasks.py, trainer/mix.py), advantages optionally standardised per task
(``--task-adv-norm``, trainer/grpo.py), and metrics per task (trainer/metrics.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import structlog
from nats.js import JetStreamContext

from agentarium.broker import START_PATIENCE_S, Topology, patiently
from agentarium.inference import wait_served

from .batch import Sample, build_rows, collate, with_task_advantages
from .checkpoint import Checkpoints, NoCheckpoints, restore_rng
from .config import TrainerConfig
from .draws import Draws, NoDraws
from .errors import TrainerConfigError
from .groups import Group, Selection
from .heap import running_allocator
from .live import LiveMetrics
from .lora import AdapterExport
from .memory import plan_for
from .metrics import MetricsSink, StepMetrics
from .prometheus import BUFFERS
from .publishing import WeightPublisher, publishing_for
from .rows import pad_token_id
from .step import StepSettings, StepStats
from .step_report import (
    ReceivedRewards,
    StepReporter,
    log_step,
    span_attributes,
    step_metrics,
    step_span,
)
from .tasks import TaskCollector, discover_agents
from .trackers import open_trackers

log = structlog.get_logger("agentarium.trainer")


def step_seed(seed: int, step: int) -> int:
    """A per-step seed from (seed, step): independent of how many steps ran in this process."""
    return (seed * 0x9E3779B97F4A7C15 + step * 0xBF58476D1CE4E5B9 + 1) % (2**63)


@dataclass
class TrainSummary:
    steps: int
    version: int
    trained: int  # trajectories trained in this process
    counters: dict = field(default_factory=dict)  # every agent's buffer, summed
    checkpoint: str | None = None
    tasks: dict[str, dict] = field(default_factory=dict)  # each agent's buffer counters


class Trainer:
    def __init__(
        self,
        config: TrainerConfig,
        js: JetStreamContext,
        *,
        topology: Topology | None = None,
        publisher: WeightPublisher | None = None,
        resume: bool = False,
        updater=None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.config = config
        # written to <checkpoint_dir>/config.yaml at start: what reproduces this run
        self.run_config = dict(run_config) if run_config is not None else asdict(config)
        self.js = js
        self.topology = topology or Topology()
        self.publishing = publishing_for(publisher, run=config.run, every=config.publish_every)
        self.resume = resume
        self.step = 0
        self.version = 0
        self.trained = 0
        self._updater = updater
        self._stop = asyncio.Event()
        self._pending: list[Group] = []  # used since the last checkpoint, unacked
        self.checkpoints: Checkpoints | NoCheckpoints = (
            Checkpoints(
                config.checkpoint_dir,
                keep=config.keep_checkpoints,
                every=config.checkpoint_every,
            )
            if config.checkpoint_dir
            else NoCheckpoints()
        )
        self.collector: TaskCollector | None = None
        self._received = ReceivedRewards()  # the policy's reward between two steps
        # run() finds the agents of '*'
        self.agents: tuple[str, ...] = () if config.discover else config.agents
        self._checkpoint_agents: tuple[str, ...] = ()
        self._running = False
        self._pad_id = 0
        self._vocab: int | None = None
        self.draws: Draws | NoDraws = NoDraws()  # dynamic sampling's (trainer/draws.py)

    def __repr__(self) -> str:
        return (
            f"<Trainer run={self.config.run} agents={'+'.join(self.agents) or '*'} "
            f"step={self.step} version={self.version} "
            f"trained={self.trained} pending_groups={len(self._pending)}>"
        )

    def stop(self) -> None:
        """Finish the current step, checkpoint, and return from run() (what SIGTERM does)."""
        self._stop.set()

    @property
    def ready(self) -> bool:
        """Collecting and training: false while loading or resuming, and once stopping."""
        return self._running and not self._stop.is_set()

    @property
    def last_checkpoint(self) -> Path | None:
        return self.checkpoints.last

    async def run(self, max_steps: int | None = None) -> TrainSummary:
        """Train until ``max_steps`` (counted from step 0, across resumes) or stop()."""
        cfg = self.config
        async with self._session() as (collector, report):
            while not self._stop.is_set() and (max_steps is None or self.step < max_steps):
                waited = time.monotonic()
                self.draws.begin(self.step + 1)
                groups = await collector.take(
                    cfg.groups_per_step,
                    Selection.of(cfg, version=self.version),
                    stop=self._stop,
                    draws=self.draws,
                )
                if groups is None:
                    break
                row = await self._train_step(groups, wait_s=time.monotonic() - waited)
                await report(row, groups)
                if self.publishing.due(self.step):
                    await self._publish()
                if self.checkpoints.due(self.step):  # without a directory: ack at once
                    await self._checkpoint()
                if cfg.sync_rollouts:
                    await self._await_served()
        return TrainSummary(
            steps=self.step,
            version=self.version,
            trained=self.trained,
            counters=dict(vars(collector.counters)),
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            tasks={a: dict(vars(c)) for a, c in collector.task_counters.items()},
        )

    # ---- setup and teardown -------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def _session(self) -> AsyncIterator[tuple[TaskCollector, StepReporter]]:
        """Everything run() needs, and its teardown: each part is closed (in reverse) once
        it exists; a last checkpoint is written only when the loop ended cleanly, since a
        half-known state must not replace the last good one."""
        async with contextlib.AsyncExitStack() as stack:
            stack.callback(self._log_stopped)
            yield await self._start(stack)

    async def _start(self, stack: contextlib.AsyncExitStack) -> tuple[TaskCollector, StepReporter]:
        cfg = self.config
        if self._updater is None:
            self._updater = await asyncio.to_thread(_make_updater, cfg)
        stack.callback(self._updater.close)
        model = self._updater.publishable_model()
        self._pad_id, self._vocab = _pad_id(model), _vocab_size(model)
        seen = await self._restore()
        # Never let one version number name two sets of weights: continue above whatever
        # was published for this run already (by a predecessor killed after publishing).
        published = await patiently(
            self.publishing.latest_version,
            patience_s=START_PATIENCE_S,
            what="reading the run's last published version",
        )
        self.version = max(self.version, published)
        if cfg.lora_rank > 0 and self.version == 0 and self.publishing.publishes:
            # engines serve an adapter only once one is loaded: publish the initial one (B = 0,
            # the base's outputs) as version 1, so rollouts can ask for it before step 1
            await self._publish()
        if cfg.sync_rollouts and not self.publishing.publishes:
            raise TrainerConfigError(
                "--sync-rollouts waits for the engines to serve each new version: it needs "
                "a weight publisher (drop --no-publish)"
            )
        self.agents = await self._resolve_agents()
        try:
            collector = TaskCollector(
                self.js, self.topology, cfg, self.agents, seen=seen, vocab_size=self._vocab
            )
        except ValueError as exc:  # --task-mix weights against the agents '*' found
            raise TrainerConfigError(str(exc)) from None
        self.collector = collector
        if cfg.dynamic_sampling:
            limit = cfg.draw_limit * cfg.groups_per_step
            self.draws = Draws(self.js._nc, self.topology, cfg.run, limit=limit)
        stack.push_async_callback(self._close_collector, collector)
        sink = MetricsSink(
            cfg.metrics_path if "csv" in cfg.report_to else None,
            attributes={"run": cfg.run, "agent": cfg.label},
            append=self.resume,
            tracker=open_trackers(cfg, resume=self.resume, start_step=self.step),
            tasks=self.agents,
        )
        stack.callback(sink.close)
        stack.push_async_exit(self._last_checkpoint)
        live = LiveMetrics(self.js, self.topology, run=cfg.run, agent=cfg.agent)
        await collector.start()
        BUFFERS.track(cfg.run, lambda: collector.counters)
        stack.callback(setattr, self, "_running", False)
        self._running = True
        log.info(
            "trainer started",
            step=self.step,
            version=self.version,
            resumed=self.resume,
            agents=list(self.agents),
            task_mix=cfg.task_mix,
        )
        return collector, StepReporter(sink, live, run=cfg.run)

    async def _last_checkpoint(self, exc_type: type | None, *_: object) -> bool:
        if exc_type is None and self._pending:
            await self._checkpoint()
        return False  # an error goes on

    async def _close_collector(self, collector: TaskCollector) -> None:
        await collector.close()
        # the last totals stay on /metrics; the trainer itself is let go
        final = replace(collector.counters)
        BUFFERS.track(self.config.run, lambda: final)

    def _log_stopped(self) -> None:
        counters = vars(self.collector.counters) if self.collector else {}
        log.info("trainer stopped", trainer=repr(self), counters=counters)

    # ---- one step ------------------------------------------------------------------------
    async def _train_step(self, groups: list[Group], *, wait_s: float) -> StepMetrics:
        cfg = self.config
        assert self.collector is not None, "run() creates the collector before any step"
        samples: list[Sample] = [s for g in groups for s in g.samples]
        started = time.monotonic()
        with step_span(groups) as span:
            rows, built = build_rows(samples, multi_turn=cfg.multi_turn)
            if cfg.task_adv_norm != "none":
                rows = with_task_advantages(rows, samples, mode=cfg.task_adv_norm, eps=cfg.adv_eps)
            if rows:
                batch = collate(rows, pad_id=self._pad_id)  # (N, T)
                seed = step_seed(cfg.seed, self.step + 1)
                stats = await asyncio.to_thread(self._updater.step, batch, seed)
            else:  # nothing generated a token (e.g. agents that never called the model)
                stats = StepStats()
            self.step += 1
            self.trained += len(samples)
            self._pending.extend(groups)
            row = step_metrics(
                groups,
                stats,
                built,
                self.collector,
                received=self._received,
                step=self.step,
                version=self.version,
                step_s=time.monotonic() - started,
                wait_s=wait_s,
                success_threshold=cfg.success_threshold,
                drawn=self.draws.drawn,
                stale_policy=cfg.stale_policy,
            )
            span.set_attributes(span_attributes(cfg.run, row, len(samples)))
        log_step(row)
        return row

    # ---- publish, checkpoint, ack ----------------------------------------------------------
    async def _publish(self) -> None:
        version = self.version + 1
        await self.publishing.publish(self._updater.publishable_model, version, self.step)
        self.version = version

    async def _await_served(self) -> None:
        """Synchronous training: block until every engine of the run serves the version just
        published (the engines KV, written by the syncers), so the next batch is generated by it
        alone. stop() ends the wait."""
        started = time.monotonic()
        version = self.version

        def waiting(waited_s: float) -> None:
            log.warning(
                "sync rollouts: still waiting for the engines to serve the new version; is "
                f"`agentarium sync --run {self.config.run}` running for every engine?",
                version=version,
                waited_s=round(waited_s, 1),
            )

        served = await wait_served(
            self.js,
            self.topology,
            self.config.run,
            version,
            stop=self._stop,
            on_wait=waiting,
            synced=True,
        )
        if served:
            log.info(
                "engines serve version",
                version=version,
                step=self.step,
                waited_s=round(time.monotonic() - started, 3),
            )

    async def _checkpoint(self) -> None:
        """Checkpoint (with a directory), then ack the groups it covers."""
        assert self.collector is not None, "pending groups were taken from the collector"
        groups, self._pending = self._pending, []
        cfg = self.config
        await asyncio.to_thread(
            self.checkpoints.snapshot,
            self._updater.write_checkpoint,
            run=cfg.run,
            groups=len(groups),
            step=self.step,
            version=self.version,
            trained_job_ids=[j for g in groups for j in g.trained_job_ids],
            # plus what was dropped on purpose since the last checkpoint, so a replay after a
            # crash does not judge it again
            consumed_job_ids=[j for g in groups for j in g.other_job_ids]
            + self.collector.take_decided(),
            extra={
                "run": cfg.run,
                "agent": cfg.agent,  # one agent's trainer, as before several
                "agents": list(self.agents),
                "consumers": {a: self.topology.trainer_consumer(cfg.run, a) for a in self.agents},
                "seed": cfg.seed,
            },
        )
        await self.collector.ack(groups)

    # ---- resume -----------------------------------------------------------------------------
    async def _restore(self) -> set[str]:
        """Restore the newest checkpoint when resuming; returns the job ids already seen."""
        cfg = self.config
        if self.resume and not cfg.checkpoint_dir:
            raise TrainerConfigError("--resume needs --checkpoint-dir")
        self.checkpoints.clean_partial()
        latest = self.checkpoints.latest()
        if latest is not None and not self.resume:
            raise TrainerConfigError(
                f"{cfg.checkpoint_dir} holds checkpoints already (latest {latest.name}): pass "
                "--resume to continue that run, or point --checkpoint-dir at an empty directory"
            )
        changed = self.checkpoints.write_config(
            self.run_config,
            header=f"agentarium trainer settings of run {cfg.run}, agents {cfg.label}: "
            "`agentarium trainer --config` reads this file",
        )
        if changed and self.resume:
            log.warning("settings changed since the last start", changed=changed)
        if latest is None:
            if self.resume:
                log.warning(
                    "resume asked but no checkpoint found; starting fresh",
                    checkpoint_dir=cfg.checkpoint_dir,
                )
            return set()
        loaded = await asyncio.to_thread(self.checkpoints.load, latest)
        self._checkpoint_agents = self._check_checkpoint(latest, loaded.state)
        await asyncio.to_thread(self._updater.read_checkpoint, loaded)
        restore_rng(loaded.rng, loaded.state)
        self.step, self.version = loaded.step, loaded.version
        seen = self.checkpoints.seen_job_ids()
        log.info(
            "resumed", checkpoint=str(latest), step=self.step, version=self.version, seen=len(seen)
        )
        return seen

    def _check_checkpoint(self, path: Path, state: Mapping[str, Any]) -> tuple[str, ...]:
        """The checkpoint's agents; refused when it is another run's, or shares no agent with
        this trainer's (a changed set of agents is allowed: each has its own consumer)."""
        cfg = self.config
        saved = tuple(state.get("agents") or ([state["agent"]] if state.get("agent") else []))
        if state.get("run") != cfg.run or (not cfg.discover and not set(saved) & set(cfg.agents)):
            raise TrainerConfigError(
                f"checkpoint {path} belongs to run {state.get('run')!r} agents "
                f"{'+'.join(saved)!r}, not {cfg.run!r}/{cfg.label!r}"
            )
        if not cfg.discover and set(saved) != set(cfg.agents):
            log.warning(
                "agents changed since the checkpoint",
                added=[a for a in cfg.agents if a not in saved],
                no_longer_trained=[a for a in saved if a not in cfg.agents],
            )
        return saved

    async def _resolve_agents(self) -> tuple[str, ...]:
        """The agents to train: as named, or for '*' found on the broker (trainer/tasks.py)."""
        cfg = self.config
        if not cfg.discover:
            return cfg.agents
        weighted = list(cfg.mix.weights) if cfg.mix.kind == "weights" else []
        also = [*cfg.named_agents, *weighted, *self._checkpoint_agents]
        found = await patiently(
            lambda: discover_agents(self.js, self.topology, cfg.run, also=also),
            patience_s=START_PATIENCE_S,
            what=f"finding the agents of run {cfg.run}",
        )
        agents = tuple(found)
        if not agents:
            raise TrainerConfigError(
                f"--agent '*' found no agent for run {cfg.run!r} (no trajectories stored, no "
                "rollout consumer): start the consumers first, or name the agents with --agent"
            )
        log.info("agents found", run=cfg.run, agents=list(agents))
        return agents


def _make_updater(config: TrainerConfig):
    settings = StepSettings.from_config(config)
    log.info(
        "trainer memory",
        plan=plan_for(config.memory, lora_rank=config.lora_rank, model_dir=config.model_dir),
        allocator=running_allocator(),
        activation_checkpointing=settings.activation_checkpointing,
        optimizer_state=settings.optimizer_state,
        max_tokens_per_micro_batch=settings.max_tokens_per_micro_batch,
        logprob_chunk=settings.logprob_chunk,
        mlp_chunk=settings.mlp_chunk,
        layer_chunk=settings.layer_chunk,
    )
    if config.parallel == "fsdp":
        from .fsdp import FsdpParallel

        return FsdpParallel(config, config.ray_workers)
    if config.ray_workers > 0:
        from .ray_dp import RayDataParallel

        return RayDataParallel(config, config.ray_workers)
    from .step import LocalUpdater

    return LocalUpdater(config)


def _policy(model):
    """The model behind what the updater publishes: with LoRA that is an ``AdapterExport``,
    whose ``config`` is the adapter's (a method) and which has no embeddings of its own."""
    return model.model if isinstance(model, AdapterExport) else model


def _vocab_size(model) -> int | None:
    """Rows the embedding cannot look up would crash a step: trajectories holding token ids
    at or above this are refused (None: not known, no such check)."""
    embeddings = getattr(_policy(model), "get_input_embeddings", None)
    return int(embeddings().num_embeddings) if callable(embeddings) else None


def _pad_id(model) -> int:
    config = _policy(model).config
    return pad_token_id(
        getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    )
