"""The rollout worker: pull jobs for one agent, run them concurrently, store trajectories.

Delivery rules (docs/design.md "Delivery and failure rules"):
- a job is acked only after its trajectory is stored (publish ack, or the server's
  "already stored" answer to ``Nats-Expected-Last-Subject-Sequence: 0``);
- a redelivered job first looks up whether its trajectory already exists;
- an undecodable/invalid job is dead-lettered and terminated; an agent error is retried
  with backoff (nak with delay), and on the last attempt stored as status ``error``,
  dead-lettered with the traceback and terminated;
- a delivery past the attempts (the previous one crashed a worker) is never run;
- SIGTERM drains: stop fetching, finish in-flight rollouts within a grace period, nak the rest.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from broker.provision import ensure_consumer, ensure_provisioned
from broker.registry import publish_worker, remove_worker
from broker.telemetry import extract_context
from broker.topology import Limits, Topology
from schemas import Job, SchemaError, Trajectory, check_name, decode

from .outcomes import TRANSIENT, OutcomeStore
from .retry import Decision, RetryPolicy
from .rollout import AgentFailure, RolloutEnv, run_rollout, trajectory_for

log = structlog.get_logger("agentarium.consumers")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True, kw_only=True)
class WorkerConfig:
    agent: str
    concurrency: int = 32
    max_fetch: int = 256
    fetch_timeout_s: float = 1.0
    ack_wait_s: float = 60.0
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    burst: bool = False
    drain_grace_s: float = 30.0
    registry_interval_s: float = 5.0
    worker_id: str = field(default_factory=default_worker_id)

    def __post_init__(self) -> None:
        check_name(self.agent, "agent")
        if self.concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if self.ack_wait_s < 3:
            raise ValueError("ack_wait_s must be >= 3 (heartbeats go out every ack_wait/3)")


@dataclass
class Counters:
    fetched: int = 0
    completed: int = 0
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    retried: int = 0
    dead_lettered: int = 0
    already_stored: int = 0
    invalid: int = 0


class Worker:
    """A rollout worker for one agent; any number of them share the agent's durable consumer."""

    def __init__(
        self,
        js: JetStreamContext,
        topo: Topology,
        config: WorkerConfig,
        env: RolloutEnv,
        limits: Limits | None = None,
    ) -> None:
        self.js = js
        self.topo = topo
        self.config = config
        self.env = env
        self.limits = limits or Limits()
        self.counters = Counters()
        self.store = OutcomeStore(js, topo, config.worker_id)
        self._inflight: dict[asyncio.Task, Msg] = {}
        self._stop = asyncio.Event()
        self._psub = None

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"<Worker {self.config.worker_id} agent={self.config.agent} in_flight={len(self._inflight)} "
            f"ok={c.ok} errors={c.errors} timeouts={c.timeouts} retried={c.retried} dead={c.dead_lettered}>"
        )

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    def stop(self) -> None:
        """Begin draining (what SIGTERM does)."""
        self._stop.set()

    # ---- main loop -------------------------------------------------------------------
    async def run(self) -> Counters:
        cfg = self.config
        consumer = self.topo.rollout_consumer_config(
            cfg.agent, self.limits, ack_wait_s=cfg.ack_wait_s, attempts=cfg.retry.attempts
        )
        await self._attach(consumer)
        log.info(
            "worker started",
            worker_id=cfg.worker_id,
            agent=cfg.agent,
            concurrency=cfg.concurrency,
            burst=cfg.burst,
            ack_wait_s=cfg.ack_wait_s,
            attempts=cfg.retry.attempts,
        )
        background = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._registry_loop()),
        ]
        try:
            await self._pull_loop()
            await self._drain()
        finally:
            for task in background:
                task.cancel()
            await asyncio.gather(*background, return_exceptions=True)
            try:
                await self._psub.unsubscribe()  # before any nc.drain(): a live pull sub hangs it
            except Exception:
                pass
            await remove_worker(self.js, self.topo, cfg.worker_id)
            log.info("worker stopped", worker=repr(self))
        return self.counters

    async def _attach(self, consumer) -> None:
        """Provision and bind the pull subscription, riding out a broker that is restarting
        or electing a leader (transient errors are retried with backoff until stop())."""
        delay = 0.2
        while True:
            try:
                await ensure_provisioned(self.js, self.topo, self.limits)
                await ensure_consumer(
                    self.js,
                    self.topo.tasks_stream,
                    consumer,
                    keys=("filter_subject", "ack_policy"),
                )
                self._psub = await self.js.pull_subscribe_bind(
                    consumer.durable_name, self.topo.tasks_stream
                )
                await self._adopt_consumer_settings(consumer.durable_name)
                return
            except (*TRANSIENT, nats.js.errors.ServiceUnavailableError) as exc:
                if self._stop.is_set():
                    raise
                log.warning(
                    "broker not ready; retrying",
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=delay,
                )
                await self._sleep_or_stop(delay)
                delay = min(5.0, delay * 2)

    async def _adopt_consumer_settings(self, durable: str) -> None:
        """The durable consumer is shared by every worker of the agent: its ack_wait and
        max_deliver are set when it is created (by ``broker init`` or the first worker) and
        then adopted by all, so workers never fight over them and a job's last delivery is
        judged the same way everywhere."""
        info = await self.js.consumer_info(self.topo.tasks_stream, durable)
        max_deliver = info.config.max_deliver or 0
        ack_wait = float(info.config.ack_wait or self.config.ack_wait_s)
        if max_deliver >= 2 and (
            max_deliver != self.config.retry.max_deliver or ack_wait != self.config.ack_wait_s
        ):
            log.warning(
                "the agent's consumer already exists with other settings: using them; change "
                "them with `agentarium broker init --agent NAME --attempts N --ack-wait S`",
                consumer=durable,
                attempts=max_deliver - 1,
                ack_wait_s=ack_wait,
                flag_attempts=self.config.retry.attempts,
                flag_ack_wait_s=self.config.ack_wait_s,
            )
            retry = replace(self.config.retry, attempts=max_deliver - 1)
            self.config = replace(self.config, retry=retry, ack_wait_s=ack_wait)

    async def _pull_loop(self) -> None:
        cfg = self.config
        errors_in_row = 0
        while not self._stop.is_set():
            free = cfg.concurrency - len(self._inflight)
            if free <= 0:
                await self._wait_for_slot()
                continue
            try:
                msgs = await self._psub.fetch(min(free, cfg.max_fetch), timeout=cfg.fetch_timeout_s)
                errors_in_row = 0
            except TimeoutError:  # nothing arrived (nats' TimeoutError is a subclass)
                if cfg.burst and await self._queue_empty():
                    return
                continue
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                errors_in_row += 1
                log.warning("fetch failed; retrying", error=str(exc) or type(exc).__name__)
                await self._sleep_or_stop(min(5.0, 0.1 * 2**errors_in_row))
                continue
            for msg in msgs:
                self.counters.fetched += 1
                task = asyncio.create_task(self._handle(msg))
                self._inflight[task] = msg
                task.add_done_callback(self._inflight.pop)

    async def _wait_for_slot(self) -> None:
        stop = asyncio.create_task(self._stop.wait())
        try:
            await asyncio.wait([stop, *self._inflight], return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()

    async def _sleep_or_stop(self, seconds: float) -> None:
        try:
            await asyncio.wait_for(self._stop.wait(), timeout=seconds)
        except TimeoutError:
            pass

    async def _queue_empty(self) -> bool:
        """Burst mode ends when nothing is pending or in flight anywhere for this agent."""
        if self._inflight:
            return False
        try:
            info = await self.js.consumer_info(
                self.topo.tasks_stream, self.topo.rollout_consumer(self.config.agent)
            )
        except (nats.errors.Error, nats.js.errors.Error):
            return False
        return not info.num_pending and not info.num_ack_pending

    async def _drain(self) -> None:
        if not self._inflight:
            return
        log.info("draining", in_flight=len(self._inflight), grace_s=self.config.drain_grace_s)
        done, pending = await asyncio.wait(list(self._inflight), timeout=self.config.drain_grace_s)
        for task in pending:
            task.cancel()  # _handle naks the message on cancellation
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
            log.warning("drain grace over; released unfinished jobs", released=len(pending))

    # ---- background ------------------------------------------------------------------
    async def _heartbeat_loop(self) -> None:
        """in_progress() on every in-flight job so long rollouts are not redelivered."""
        period = self.config.ack_wait_s / 3
        while True:
            await asyncio.sleep(period)
            for msg in list(self._inflight.values()):
                try:
                    await msg.in_progress()
                except (
                    Exception
                ) as exc:  # a lost heartbeat only risks a redelivery, which is handled
                    log.debug("heartbeat failed", error=str(exc))

    async def _registry_loop(self) -> None:
        cfg = self.config
        started = time.time()
        last_time, last_done = started, 0
        while True:
            now = time.time()
            # rollouts/s over the last interval: what `broker status` sums per agent
            rate = (self.counters.completed - last_done) / max(now - last_time, 1e-9)
            last_time, last_done = now, self.counters.completed
            info = {
                "agent": cfg.agent,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "concurrency": cfg.concurrency,
                "in_flight": len(self._inflight),
                "started_at": started,
                "rollouts_per_s": round(rate, 2),
                **vars(self.counters),
            }
            try:
                await publish_worker(self.js, self.topo, cfg.worker_id, info)
            except Exception as exc:  # registry is informational; never stop the worker for it
                log.debug("registry update failed", error=str(exc))
            await asyncio.sleep(cfg.registry_interval_s)

    # ---- one message -------------------------------------------------------------------
    async def _handle(self, msg: Msg) -> None:
        try:
            await self._process(msg)
        except asyncio.CancelledError:
            await self._settle(msg.nak())
            raise
        except Exception as exc:
            if msg.metadata.num_delivered < self.config.retry.max_deliver:
                log.exception("unexpected error handling a job; releasing it for redelivery")
                await self._settle(msg.nak(delay=self.config.retry.delay_s(1)))
                return
            # The server will not deliver it again: a nak would strand it in the work queue
            # forever. Dead-letter it if we still can, and terminate it either way.
            log.exception("unexpected error on a job's last delivery; terminating it")
            try:
                await self.store.dead_letter(
                    msg.subject,
                    msg.data,
                    reason="worker_error",
                    error=repr(exc),
                    attempts=msg.metadata.num_delivered,
                )
                self.counters.dead_lettered += 1
            except Exception as letter_exc:  # noqa: BLE001 - the term() below must still happen
                log.error("dead letter failed too; the job is dropped", error=repr(letter_exc))
            await self._settle(msg.term())

    async def _settle(self, coro: Any) -> None:
        try:
            await coro
        except Exception as exc:
            log.warning("ack/nak failed; the job will be redelivered", error=str(exc))

    async def _process(self, msg: Msg) -> None:
        attempt = msg.metadata.num_delivered
        headers = msg.headers or {}
        try:
            job = decode(Job, msg.data, headers.get("Content-Type"))
        except SchemaError as exc:
            self.counters.invalid += 1
            await self._dead_letter(msg, reason="invalid_job", error=str(exc), attempts=attempt)
            return
        subject_agent = self.topo.agent_of_subject(msg.subject)
        if job.agent != subject_agent:
            self.counters.invalid += 1
            await self._dead_letter(
                msg,
                job=job,
                reason="wrong_subject",
                attempts=attempt,
                error=f"job.agent {job.agent!r} does not match its subject {msg.subject!r}",
            )
            return
        if self.config.retry.on_delivery(attempt) is Decision.DEAD_LETTER:
            error = (
                f"delivered {attempt} times without an acknowledgement (worker crash or ack timeout "
                f"on the last of {self.config.retry.attempts} attempts)"
            )
            if not await self._stored(job):
                await self._publish(self._failed(job, error, attempt))
            await self._dead_letter(
                msg, job=job, reason="max_deliveries", error=error, attempts=attempt
            )
            return
        if attempt > 1 and await self._stored(job):
            self.counters.already_stored += 1
            await msg.ack()
            return
        try:
            trajectory = await run_rollout(
                job, self.env, attempt=attempt, parent=extract_context(headers), subject=msg.subject
            )
        except AgentFailure as failure:
            if not self.config.retry.is_last_attempt(attempt):
                self.counters.retried += 1
                delay = self.config.retry.delay_s(attempt)
                log.warning(
                    "agent failed; retrying",
                    job_id=job.job_id,
                    attempt=attempt,
                    delay_s=round(delay, 2),
                    error=failure.error.strip().splitlines()[-1][:300],
                )
                await msg.nak(delay=delay)
                return
            await self._publish(
                self._failed(
                    job, failure.error, attempt, calls=failure.calls, trace_id=failure.trace_id
                )
            )
            await self._dead_letter(
                msg, job=job, reason="agent_error", error=failure.error, attempts=attempt
            )
            return
        await self._publish(trajectory)
        self._count(trajectory)
        await msg.ack()

    def _count(self, trajectory: Trajectory) -> None:
        self.counters.completed += 1
        if trajectory.status == "ok":
            self.counters.ok += 1
        elif trajectory.status == "timeout":
            self.counters.timeouts += 1
        else:
            self.counters.errors += 1

    def _failed(
        self, job: Job, error: str, attempt: int, *, calls: list | None = None, trace_id: str = ""
    ) -> Trajectory:
        self.counters.completed += 1
        self.counters.errors += 1
        now = time.time()
        return trajectory_for(
            job,
            self.config.worker_id,
            status="error",
            error=error,
            attempts=attempt,
            started_at=now,
            finished_at=now,
            trace_id=trace_id,
            calls=calls or [],
        )

    async def _stored(self, job: Job) -> bool:
        return await self.store.stored(job)

    async def _publish(self, trajectory: Trajectory) -> None:
        if not await self.store.publish_trajectory(trajectory):
            self.counters.already_stored += 1

    async def _dead_letter(
        self, msg: Msg, *, reason: str, error: str, attempts: int, job: Job | None = None
    ) -> None:
        """Publish the job with its reason to DEAD, then term() it (removing it from the queue)."""
        letter = await self.store.dead_letter(
            msg.subject, msg.data, reason=reason, error=error, attempts=attempts, job=job
        )
        self.counters.dead_lettered += 1
        log.warning(
            "job dead-lettered",
            reason=reason,
            job_id=letter.job_id,
            subject=msg.subject,
            attempts=attempts,
            error=error.strip().splitlines()[-1][:300] if error.strip() else "",
        )
        await msg.term()
