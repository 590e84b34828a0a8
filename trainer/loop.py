"""The Trainer: asynchronous GRPO as one loop.

    while steps remain:
        groups  = await collector.take(B)            # oldest complete groups, staleness applied
        batch   = collate(build_rows(samples))       # (B, T) tensors, loss on model tokens only
        stats   = updater.step(batch, seed(step))    # forward, GRPO loss, backward, clip, AdamW
        metrics.record(step)                         # CSV + OpenTelemetry + trackers
        live.publish(step)                           # the same row on <p>.metrics.<run>
        every publish_every steps:    version += 1; await publisher.publish(model, version, step)
        every checkpoint_every steps: checkpoint, then ack the groups it covers
        with sync_rollouts:           await every engine serving `version` (broker.wait_served)

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
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import structlog
import torch
from nats.js import JetStreamContext
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN_ID, Link, SpanContext, TraceFlags

from broker import OPENINFERENCE_SPAN_KIND, Topology, extract_context, wait_served

from .batch import Sample, build_rows, collate, with_task_advantages
from .checkpoint import Checkpoints, restore_rng
from .config import TrainerConfig
from .errors import TrainerConfigError
from .groups import Group
from .live import LiveMetrics
from .metrics import MetricsSink, StepMetrics, TaskMetrics
from .prometheus import BUFFERS, CHECKPOINT_SECONDS, PUBLISH_SECONDS, record_step
from .rows import pad_token_id
from .tasks import TaskCollector, discover_agents
from .trackers import open_trackers

log = structlog.get_logger("agentarium.trainer")
tracer = trace.get_tracer("agentarium.trainer")

LINKS_PER_SPAN = 4096  # broker.telemetry raises the SDK's default of 128 to this


@runtime_checkable
class WeightPublisher(Protocol):
    """Makes a new policy version available to the fleet (trainer/weights.py has the real one).

    ``publish`` must return only once the version is durable (object store, then KV). A
    publisher may also offer ``async latest_version() -> int | None``: a resumed trainer then
    numbers its next version above anything a killed predecessor published after its last
    checkpoint, so one version number never names two different sets of weights.
    """

    # Returns whatever it likes (RunPublisher: the WeightUpdate); the loop ignores it.
    async def publish(self, model: torch.nn.Module, version: int, step: int) -> object: ...


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
        self.publisher = publisher
        self.resume = resume
        self.step = 0
        self.version = 0
        self.trained = 0
        self._updater = updater
        self._stop = asyncio.Event()
        self._pending: list[Group] = []  # used since the last checkpoint, unacked
        self.checkpoints = (
            Checkpoints(config.checkpoint_dir, keep=config.keep_checkpoints)
            if config.checkpoint_dir
            else None
        )
        self.collector: TaskCollector | None = None
        # run() finds the agents of '*'
        self.agents: tuple[str, ...] = () if config.discover else config.agents
        self._checkpoint_agents: tuple[str, ...] = ()
        self.last_checkpoint: Path | None = None
        self._running = False
        self._vocab: int | None = None

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

    async def run(self, max_steps: int | None = None) -> TrainSummary:
        """Train until ``max_steps`` (counted from step 0, across resumes) or stop()."""
        cfg = self.config
        metrics = None
        failed = False
        try:
            seen = await self._setup()
            # Never let one version number name two sets of weights: continue above whatever
            # was published for this run already (by a predecessor killed after publishing).
            latest_version = getattr(self.publisher, "latest_version", None)
            if latest_version is not None:
                self.version = max(self.version, int(await latest_version() or 0))
            if cfg.sync_rollouts and self.publisher is None:
                raise TrainerConfigError(
                    "--sync-rollouts waits for the engines to serve each new version: it needs "
                    "a weight publisher (drop --no-publish)"
                )
            self.agents = await self._resolve_agents()
            try:
                self.collector = TaskCollector(
                    self.js, self.topology, cfg, self.agents, seen=seen, vocab_size=self._vocab
                )
            except ValueError as exc:  # --task-mix weights against the agents '*' found
                raise TrainerConfigError(str(exc)) from None
            metrics = MetricsSink(
                cfg.metrics_path if "csv" in cfg.report_to else None,
                attributes={"run": cfg.run, "agent": cfg.label},
                append=self.resume,
                tracker=open_trackers(cfg, resume=self.resume, start_step=self.step),
                tasks=self.agents,
            )
            live = LiveMetrics(self.js, self.topology, run=cfg.run, agent=cfg.agent)
            await self.collector.start()
            BUFFERS.track(cfg.run, lambda: self.collector.counters if self.collector else None)
            self._running = True
            log.info(
                "trainer started",
                step=self.step,
                version=self.version,
                resumed=self.resume,
                agents=list(self.agents),
                task_mix=cfg.task_mix,
            )
            while not self._stop.is_set() and (max_steps is None or self.step < max_steps):
                waited = time.monotonic()
                groups = await self.collector.take(
                    cfg.groups_per_step,
                    version=self.version,
                    max_staleness=cfg.max_staleness,
                    stale_policy=cfg.stale_policy,
                    filter_flat=cfg.filter_flat_groups,
                    std_norm=cfg.std_norm,
                    eps=cfg.adv_eps,
                    stop=self._stop,
                )
                if groups is None:
                    break
                row = await self._train_step(groups, wait_s=time.monotonic() - waited)
                metrics.record(row)
                record_step(cfg.run, row, trajectories=sum(len(g.samples) for g in groups))
                await live.publish(row)
                if self.publisher is not None and self.step % cfg.publish_every == 0:
                    await self._publish()
                if self.checkpoints is None:
                    groups, self._pending = self._pending, []
                    await self.collector.ack(groups)
                elif self.step % cfg.checkpoint_every == 0:
                    await self._checkpoint()
                if cfg.sync_rollouts:
                    await self._await_served()
        except BaseException:
            failed = True  # no checkpoint of a half-known state: the last one stands
            raise
        finally:
            self._running = False
            try:
                if not failed and self._pending and self.checkpoints is not None:
                    await self._checkpoint()
            finally:
                if self.collector is not None:
                    await self.collector.close()
                    # the last totals stay on /metrics; the trainer itself is let go
                    final = replace(self.collector.counters)
                    BUFFERS.track(cfg.run, lambda: final)
                if metrics is not None:
                    metrics.close()
                if self._updater is not None:
                    self._updater.close()
                counters = vars(self.collector.counters) if self.collector else {}
                log.info("trainer stopped", trainer=repr(self), counters=counters)
        return TrainSummary(
            steps=self.step,
            version=self.version,
            trained=self.trained,
            counters=dict(vars(self.collector.counters)),
            checkpoint=str(self.last_checkpoint) if self.last_checkpoint else None,
            tasks={a: dict(vars(c)) for a, c in self.collector.task_counters.items()},
        )

    # ---- one step ------------------------------------------------------------------------
    async def _train_step(self, groups: list[Group], *, wait_s: float) -> StepMetrics:
        cfg = self.config
        samples: list[Sample] = [s for g in groups for s in g.samples]
        started = time.monotonic()
        links = _links(groups)
        chain = {OPENINFERENCE_SPAN_KIND: "CHAIN"}
        with tracer.start_as_current_span(
            "train step", links=links[:LINKS_PER_SPAN], attributes=chain
        ) as span:
            for start in range(LINKS_PER_SPAN, len(links), LINKS_PER_SPAN):
                # Past one span's limit: child spans carry the rest of the links.
                chunk = links[start : start + LINKS_PER_SPAN]
                with tracer.start_as_current_span(
                    "train step links", links=chunk, attributes=chain
                ):
                    pass
            rows, built = build_rows(samples, multi_turn=cfg.multi_turn)
            if cfg.task_adv_norm != "none":
                rows = with_task_advantages(rows, samples, mode=cfg.task_adv_norm, eps=cfg.adv_eps)
            if rows:
                batch = collate(rows, pad_id=self._pad_id)
                stats = await asyncio.to_thread(
                    self._updater.step, batch, step_seed(cfg.seed, self.step + 1)
                )
            else:  # nothing generated a token (e.g. agents that never called the model)
                from .step import StepStats

                stats = StepStats()
            self.step += 1
            self.trained += len(samples)
            self._pending.extend(groups)
            step_s = time.monotonic() - started
            rewards: list[float] = []
            for s in samples:  # samples come from trainable (status ok) members only
                assert s.trajectory.reward is not None, (
                    "status ok implies a reward (Trajectory.__post_init__)"
                )
                rewards.append(float(s.trajectory.reward))
            staleness = [x for g in groups for x in g.staleness]
            assert self.collector is not None, "run() creates the collector before any step"
            c = self.collector.counters
            row = StepMetrics(
                step=self.step,
                version=self.version,
                reward_mean=statistics.fmean(rewards) if rewards else 0.0,
                reward_std=statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
                loss=stats.loss,
                kl=stats.kl,
                clip_frac=stats.clip_frac,
                entropy=stats.entropy,
                tokens=stats.tokens,
                tokens_per_s=stats.tokens / step_s if step_s > 0 else 0.0,
                step_s=step_s,
                groups_used=len(groups),
                dropped_stale=c.dropped_stale,
                dropped_flat=c.dropped_flat,
                staleness_max=max(staleness, default=0),
                staleness_mean=statistics.fmean(staleness) if staleness else 0.0,
                staleness_hist=self.collector.staleness_histogram(groups),
                model_tokens=stats.model_tokens,
                rows=stats.rows,
                grad_norm=stats.grad_norm,
                ratio_mean=stats.ratio_mean,
                wait_s=wait_s,
                tis_weighted=c.tis_weighted,
                prefix_mismatches=built.prefix_mismatches,
                failed_members=c.failed_members,
                refused=c.refused,
                validation_skipped=c.validation_skipped,
                tasks=self._task_metrics(groups),
            )
            span.set_attributes(
                {
                    "agentarium.run": cfg.run,
                    "agentarium.step": self.step,
                    "agentarium.version": self.version,
                    "agentarium.groups": len(groups),
                    "agentarium.trajectories": len(samples),
                    "agentarium.tokens": stats.tokens,
                    "agentarium.loss": stats.loss,
                    "agentarium.reward_mean": row.reward_mean,
                }
            )
        log.info(
            "step done",
            step=self.step,
            version=self.version,
            reward_mean=round(row.reward_mean, 4),
            loss=round(row.loss, 6),
            groups=len(groups),
            tokens=row.tokens,
            step_s=round(step_s, 3),
            dropped_stale=row.dropped_stale,
            **(
                {"groups_by_task": {a: t.groups for a, t in row.tasks.items()}}
                if len(row.tasks) > 1
                else {}
            ),
        )
        return row

    def _task_metrics(self, groups: list[Group]) -> dict[str, TaskMetrics]:
        assert self.collector is not None, "run() creates the collector before any step"
        threshold = self.config.success_threshold
        out: dict[str, TaskMetrics] = {}
        for agent, counters in self.collector.task_counters.items():
            mine = [g for g in groups if g.task == agent]
            rewards: list[float] = []
            lengths: list[int] = []
            for s in (s for g in mine for s in g.samples):
                assert s.trajectory.reward is not None, "trained samples are status ok"
                rewards.append(float(s.trajectory.reward))
                lengths.append(sum(len(call.response_ids) for call in s.trajectory.calls))
            out[agent] = TaskMetrics(
                groups=len(mine),
                trajectories=len(rewards),
                reward_mean=statistics.fmean(rewards) if rewards else None,
                success=statistics.fmean(r >= threshold for r in rewards) if rewards else None,
                length=statistics.fmean(lengths) if lengths else None,
                dropped_stale=counters.dropped_stale,
                dropped_groups=counters.dropped_groups,
            )
        return out

    # ---- publish, checkpoint, ack ----------------------------------------------------------
    async def _publish(self) -> None:
        version = self.version + 1
        started = time.monotonic()
        model = await asyncio.to_thread(self._updater.publishable_model)
        assert self.publisher is not None, "run() publishes only when it has a publisher"
        await self.publisher.publish(model, version, self.step)
        self.version = version
        PUBLISH_SECONDS.labels(self.config.run).observe(time.monotonic() - started)
        log.info(
            "version published",
            version=version,
            step=self.step,
            publish_s=round(time.monotonic() - started, 3),
        )

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
            self.js, self.topology, self.config.run, version, stop=self._stop, on_wait=waiting
        )
        if served:
            log.info(
                "engines serve version",
                version=version,
                step=self.step,
                waited_s=round(time.monotonic() - started, 3),
            )

    async def _checkpoint(self) -> None:
        groups, self._pending = self._pending, []
        started = time.monotonic()
        model_state, optimizer_state = await asyncio.to_thread(self._updater.state)
        assert self.checkpoints is not None, "run() checkpoints only with a checkpoint_dir"
        path = await asyncio.to_thread(
            self.checkpoints.save,
            step=self.step,
            version=self.version,
            model_state=model_state,
            optimizer_state=optimizer_state,
            trained_job_ids=[j for g in groups for j in g.trained_job_ids],
            # plus what was dropped on purpose since the last checkpoint, so a replay after a
            # crash does not judge it again
            consumed_job_ids=[j for g in groups for j in g.other_job_ids]
            + (self.collector.take_decided() if self.collector else []),
            extra={
                "run": self.config.run,
                "agent": self.config.agent,  # one agent's trainer, as before several
                "agents": list(self.agents),
                "consumers": {
                    a: self.topology.trainer_consumer(self.config.run, a) for a in self.agents
                },
                "seed": self.config.seed,
            },
        )
        self.last_checkpoint = path
        CHECKPOINT_SECONDS.labels(self.config.run).observe(time.monotonic() - started)
        log.info(
            "checkpoint saved",
            step=self.step,
            version=self.version,
            path=str(path),
            groups=len(groups),
        )
        assert self.collector is not None, "pending groups were taken from the collector"
        await self.collector.ack(groups)

    # ---- setup ------------------------------------------------------------------------------
    async def _setup(self) -> set[str]:
        """Build the updater, restore a checkpoint if resuming; returns the seen job ids."""
        cfg = self.config
        if self._updater is None:
            self._updater = await asyncio.to_thread(_make_updater, cfg)
        model = self._updater.publishable_model()
        self._pad_id = _pad_id(model)
        self._vocab = _vocab_size(model)
        seen: set[str] = set()
        if self.checkpoints is None:
            if self.resume:
                raise TrainerConfigError("--resume needs --checkpoint-dir")
            return seen
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
            return seen
        loaded = await asyncio.to_thread(self.checkpoints.load, latest)
        self._checkpoint_agents = self._check_checkpoint(latest, loaded.state)
        await asyncio.to_thread(
            self._updater.load_state, loaded.model_state, loaded.optimizer_state
        )
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
        agents = tuple(await discover_agents(self.js, self.topology, cfg.run, also=also))
        if not agents:
            raise TrainerConfigError(
                f"--agent '*' found no agent for run {cfg.run!r} (no trajectories stored, no "
                "rollout consumer): start the consumers first, or name the agents with --agent"
            )
        log.info("agents found", run=cfg.run, agents=list(agents))
        return agents


def _make_updater(config: TrainerConfig):
    if config.ray_workers > 0:
        from .ray_dp import RayDataParallel

        return RayDataParallel(config, config.ray_workers)
    from .step import LocalUpdater

    return LocalUpdater(config)


def _vocab_size(model) -> int | None:
    """Rows the embedding cannot look up would crash a step: trajectories holding token ids
    at or above this are refused (None: not known, no such check)."""
    embeddings = getattr(model, "get_input_embeddings", None)
    return int(embeddings().num_embeddings) if callable(embeddings) else None


def _pad_id(model) -> int:
    config = model.config
    return pad_token_id(
        getattr(config, "pad_token_id", None), getattr(config, "eos_token_id", None)
    )


def _links(groups: list[Group]) -> list[Link]:
    """One link per used trajectory, to the ``rollout`` span that produced it: the trajectory
    keeps that span's trace and span ids. A trajectory without a span id (from a writer older
    than the field) is linked to the span of a ``traceparent`` its message carries, else to
    its trace alone, with span id zero: the spec lets such a link be recorded since it has
    attributes, but a viewer cannot follow it to a span."""
    links = []
    for group in groups:
        for sample in group.samples:
            traj = sample.trajectory
            attrs = {"agentarium.job_id": traj.job_id, "agentarium.group_id": traj.group_id}
            trace_id, span_id = _hex_id(traj.trace_id, 32), _hex_id(traj.span_id, 16)
            if trace_id and span_id:
                flags = TraceFlags(TraceFlags.SAMPLED)
                links.append(Link(SpanContext(trace_id, span_id, True, flags), attrs))
                continue
            member = group.members.get(traj.job_id)
            headers = getattr(getattr(member, "handle", None), "headers", None) or {}
            parent = trace.get_current_span(extract_context(headers)).get_span_context()
            if parent.is_valid:
                links.append(Link(parent, attrs))
            elif trace_id:
                ctx = SpanContext(
                    trace_id,
                    INVALID_SPAN_ID,
                    is_remote=True,
                    trace_flags=TraceFlags(TraceFlags.SAMPLED),
                )
                links.append(Link(ctx, attrs))
    return links


def _hex_id(text: str, digits: int) -> int:
    """A trace (32) or span (16) id from its hex digits; 0, the invalid id, for anything else."""
    if len(text) != digits:
        return 0
    try:
        return int(text, 16)
    except ValueError:
        return 0
