"""DeliveryHandler: one delivery of a job, decode → decide → run → settle.

What to do with a delivery (run, ack, nak with a delay, dead-letter and term) is decided by
``DeliveryPolicy`` (consumers/delivery.py) alone, on the ``Event`` that handling found out; a
rollout's result (consumers/rollout_result.py) becomes that event here. Settling stores first
and acks after: a job is acked only once its trajectory is stored.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.msg import Msg

from agentarium.broker import Topology, extract_context
from agentarium.schemas import Job, SchemaError, Trajectory, decode

from ..delivery import Action, Decision, DeliveryPolicy, Event
from ..metrics import RolloutMetrics
from ..redact import log_safe
from ..rollout import RolloutEnv, run_rollout, trajectory_for
from ..rollout_result import AgentFailed, EnvironmentLost, Finished
from .counters import Counters
from .store import TrajectoryStore, releases

log = structlog.get_logger("agentarium.consumers")

# A job released by a drain is published again (or, failing that, naked or dead-lettered), but
# the drain's grace is already over: give that this long (the broker may be the reason for the
# drain). Manifests size their termination grace to --drain-grace plus this (docs/operations.md).
RELEASE_S = 5.0


@dataclass(frozen=True, kw_only=True)
class Handled:
    """What handling one delivery found out: the event the policy decides on, and what
    settling the decision needs."""

    event: Event
    job: Job | None = None
    trajectory: Trajectory | None = None  # the rollout's, to store (OK / TIMEOUT / ERROR)
    error: str = ""  # why it failed: the dead letter's / error trajectory's text
    calls: list = field(default_factory=list)  # an agent error's calls so far
    trace_id: str = ""
    span_id: str = ""  # the failed attempt's rollout span


RELEASED = Handled(event=Event.RELEASED, error="released by a drain")


class DeliveryHandler:
    """Handles the deliveries of one agent's jobs; nothing escapes ``handle``."""

    def __init__(
        self,
        *,
        topo: Topology,
        policy: DeliveryPolicy,
        store: TrajectoryStore,
        env: RolloutEnv,
        counters: Counters,
        metrics: RolloutMetrics,
    ) -> None:
        self.topo = topo
        self.policy = policy
        self.store = store
        self.env = env
        self.counters = counters
        self.metrics = metrics

    async def handle(self, msg: Msg) -> None:
        """Handle one delivery; a cancellation (a drain) releases the job, then goes on."""
        try:
            await self._process(msg)
        except asyncio.CancelledError:
            await self.release(msg)
            raise
        except Exception as exc:
            await self._fall_back(msg, Handled(event=Event.WORKER_ERROR, error=repr(exc)), exc)

    async def release(self, msg: Msg) -> None:
        """Give the job back unrun, as a drain does."""
        await self._fall_back(msg, RELEASED)

    async def _process(self, msg: Msg) -> None:
        delivery = msg.metadata.num_delivered
        handled = self._decode(msg)
        # A redelivery follows a failed run or a lost delivery: only the failures count. A
        # requeued job (released by a drain, published again) keeps its count the same way.
        requeued = releases(msg) > 0
        failures = 0
        if handled.job is not None and (delivery > 1 or requeued):
            failures = await self.store.failures(handled.job, delivery)
        decision = self.policy.decide(handled.event, delivery, failures, requeued=requeued)
        if decision.action is Action.RUN:
            assert handled.job is not None  # RUN is only decided for a decoded job
            handled = await self._run(msg, handled.job, delivery, decision)
            decision = self.policy.decide(handled.event, delivery, failures, requeued=requeued)
        await self._settle(msg, decision, handled, delivery, failures)

    def _decode(self, msg: Msg) -> Handled:
        headers = msg.headers or {}
        try:
            job = decode(Job, msg.data, headers.get("Content-Type"))
        except SchemaError as exc:
            return Handled(event=Event.INVALID_JOB, error=str(exc))
        if job.agent != self.topo.agent_of_subject(msg.subject):
            error = f"job.agent {job.agent!r} does not match its subject {msg.subject!r}"
            return Handled(event=Event.WRONG_SUBJECT, job=job, error=error)
        return Handled(event=Event.RECEIVED, job=job)

    async def _run(self, msg: Msg, job: Job, delivery: int, decision: Decision) -> Handled:
        if decision.check_stored and await self.store.stored(job):
            return Handled(event=Event.ALREADY_STORED, job=job)
        parent = extract_context(msg.headers or {})
        started = time.monotonic()
        result = await run_rollout(
            job, self.env, attempt=delivery, parent=parent, subject=msg.subject
        )
        match result:
            case Finished(trajectory=trajectory):
                trajectory = self.store.fitted(trajectory)  # over max_payload: an error
                self.metrics.rollout(trajectory.status, time.monotonic() - started)
                return Handled(
                    event=Event(trajectory.status),  # ok / timeout / error
                    job=job,
                    trajectory=trajectory,
                    error=trajectory.error or "",
                )
            case EnvironmentLost(trajectory=trajectory):
                self.metrics.rollout("env_unavailable", time.monotonic() - started)
                return Handled(
                    event=Event.ENV_UNAVAILABLE,
                    job=job,
                    trajectory=trajectory,
                    error=trajectory.error or "",
                    calls=list(trajectory.calls),
                    trace_id=trajectory.trace_id,
                    span_id=trajectory.span_id,
                )
            case AgentFailed():
                self.metrics.rollout("agent_error", time.monotonic() - started)
                return Handled(
                    event=Event.AGENT_ERROR,
                    job=job,
                    error=result.error,
                    calls=result.calls,
                    trace_id=result.trace_id,
                    span_id=result.span_id,
                )
        raise AssertionError(f"no event for {result!r}")

    async def _settle(
        self, msg: Msg, decision: Decision, handled: Handled, delivery: int, failures: int = 0
    ) -> None:
        """Carry out the decision: whatever must be stored first, then ack, nak or term."""
        job = handled.job
        match decision.action:
            case Action.ACK:
                if handled.trajectory is None:
                    self.counters.already_stored += 1
                    self.metrics.already_stored.inc()
                else:
                    await self._publish(handled.trajectory)
                    self.counters.stored(handled.trajectory.status)
                if handled.event in (Event.ERROR, Event.ENV_UNAVAILABLE):
                    self.counters.failed += 1
                    log.warning(
                        "rollout failed",
                        job_id=job.job_id if job else "",
                        attempt=delivery,
                        status="error",
                        error=log_safe(handled.error),
                    )
                await msg.ack()
            case Action.NAK:
                if handled.event in (Event.AGENT_ERROR, Event.ENV_UNAVAILABLE):
                    self.counters.retried += 1
                    self.metrics.retries.inc()
                    log.warning(
                        "agent failed; retrying"
                        if handled.event is Event.AGENT_ERROR
                        else "environment unavailable; retrying",
                        job_id=job.job_id if job else "",
                        attempt=failures + 1,
                        delivery=delivery,
                        delay_s=round(decision.delay_s, 2),
                        error=log_safe(handled.error),
                    )
                if decision.count_failure and job is not None:
                    await self.store.count_failure(job, failures + 1)
                await msg.nak(delay=decision.delay_s or None)
            case Action.DEAD_LETTER:
                if handled.event in (Event.INVALID_JOB, Event.WRONG_SUBJECT):
                    self.counters.invalid += 1
                error = handled.error or decision.detail
                if decision.record_error and job is not None:
                    await self._record_error(job, handled, error, delivery, decision)
                await self._dead_letter(
                    msg, reason=decision.reason, error=error, attempts=delivery, job=job
                )
            case _:
                raise AssertionError(f"cannot settle {decision}")

    async def _fall_back(
        self, msg: Msg, handled: Handled, exc: BaseException | None = None
    ) -> None:
        """Settle a delivery whose handling raised or was cancelled. Nothing may escape from
        here, and a job on its last delivery is terminated even when its dead letter cannot
        be written: a nak would strand it in the work queue forever."""
        delivery = msg.metadata.num_delivered
        decision = self.policy.decide(handled.event, delivery)
        if decision.action is Action.REQUEUE:
            try:
                async with asyncio.timeout(RELEASE_S):
                    await self.store.requeue(msg)
                self.counters.released += 1
                await _quietly(msg.ack())
                return
            except Exception as requeue_exc:  # noqa: BLE001 - the nak or term below must happen
                log.warning(
                    "could not requeue a released job; naking it (this spends a delivery)",
                    subject=msg.subject,
                    delivery=delivery,
                    error=repr(requeue_exc) if not str(requeue_exc) else str(requeue_exc),
                )
                handled = Handled(event=Event.REQUEUE_FAILED, error=handled.error)
                decision = self.policy.decide(handled.event, delivery)
        if decision.action is Action.NAK:
            if exc is not None:
                log.error(
                    "unexpected error handling a job; releasing it for redelivery", exc_info=exc
                )
            await _quietly(msg.nak(delay=decision.delay_s or None))
            return
        if exc is not None:
            log.error("unexpected error on a job's last delivery; terminating it", exc_info=exc)
        # A drain's grace is over already: the dead letter gets a short bound of its own.
        bound = RELEASE_S if handled.event is Event.REQUEUE_FAILED else None
        try:
            async with asyncio.timeout(bound):
                await self.store.dead_letter(
                    msg.subject,
                    msg.data,
                    reason=decision.reason,
                    error=handled.error,
                    attempts=delivery,
                )
            self.counters.dead_lettered += 1
            self.counters.failed += 1
            self.metrics.dead_letter(decision.reason)
        except Exception as letter_exc:  # noqa: BLE001 - the term() below must still happen
            log.error("dead letter failed too; the job is dropped", error=repr(letter_exc))
        await _quietly(msg.term())

    async def _record_error(
        self, job: Job, handled: Handled, error: str, delivery: int, decision: Decision
    ) -> None:
        """Store the job's error trajectory, unless (``check_stored``) an earlier delivery did."""
        if decision.check_stored and await self.store.stored(job):
            return
        self.counters.stored("error")
        now = time.time()
        trajectory = trajectory_for(
            job,
            self.store.worker_id,
            status="error",
            error=error,
            attempts=delivery,
            started_at=now,
            finished_at=now,
            trace_id=handled.trace_id,
            span_id=handled.span_id,
            calls=handled.calls,
        )
        await self._publish(trajectory)

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
        self.counters.failed += 1
        self.metrics.dead_letter(reason)
        log.warning(
            "job dead-lettered",
            reason=reason,
            job_id=letter.job_id,
            subject=msg.subject,
            attempts=attempts,
            error=log_safe(error),
        )
        await msg.term()


async def _quietly(coro: Any) -> None:
    try:
        await coro
    except Exception as exc:
        log.warning("ack/nak failed; the job will be redelivered", error=str(exc))
