"""The rollout worker: pull jobs for one agent, run them concurrently, store trajectories.

Delivery rules (docs/design.md "Delivery and failure rules"):
- a job is acked only after its trajectory is stored (publish ack, or the server's
  "already stored" answer to ``Nats-Expected-Last-Subject-Sequence: 0``);
- a redelivered job first looks up whether its trajectory already exists;
- an undecodable/invalid job is dead-lettered and terminated; an agent error is retried
  with backoff (nak with delay), and on the last attempt stored as status ``error``,
  dead-lettered with the traceback and terminated;
- a delivery past the attempts (the previous one crashed a worker) is never run;
- SIGTERM drains: stop fetching, finish in-flight rollouts within a grace period, nak the rest
  (dead-letter and term one on its last delivery: a nak would strand it);
- while the agent's LLM fleet is down within its outage limit (consumers/fleet.py), fetch
  nothing: in-flight rollouts wait for the fleet, heartbeated, on their current delivery.

Each delivery goes decode → decide → run → settle; what to do with it (run, ack, nak with a
delay, dead-letter and term) is decided by ``DeliveryPolicy`` (consumers/delivery.py) alone.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from broker import (
    TRANSIENT_NATS_ERRORS,
    Limits,
    Topology,
    ensure_consumer,
    ensure_provisioned,
    extract_context,
    publish_worker,
    remove_worker,
)
from schemas import Job, SchemaError, Trajectory, check_name, decode

from .config import ConsumerSettings
from .delivery import Action, Decision, Event
from .fleet import fleets_summary
from .metrics import RolloutMetrics
from .outcomes import OutcomeStore
from .puller import JobPuller
from .redact import log_safe
from .rollout import AgentFailure, EnvFailure, RolloutEnv, run_rollout, trajectory_for

log = structlog.get_logger("agentarium.consumers")

BACKGROUND_STOP_S = 5.0  # how long stopping waits for the heartbeat and registry loops
HEARTBEAT_CHUNK = 500  # heartbeats sent between two turns of the event loop

# A job released by a drain on its last delivery is dead-lettered, but the drain's grace is
# already over: give the dead letter this long (the broker may be the reason for the drain).
RELEASE_DEAD_LETTER_S = 5.0

# What _attach rides out: a broker restarting, or still electing the stream's leader.
_ATTACH_RETRYABLE: tuple[type[Exception], ...] = (
    *TRANSIENT_NATS_ERRORS,
    nats.js.errors.ServiceUnavailableError,
)


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
    # Jobs that ended here without a usable rollout: stored as status error (the LLM fleet
    # failed) and/or dead-lettered, each job counted once. What a caller checks to report
    # failure (``errors`` misses dead letters; ``dead_lettered`` misses a dead fleet).
    failed: int = 0


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """What handling one delivery found out: the event the policy decides on, and what
    settling the decision needs."""

    event: Event
    job: Job | None = None
    trajectory: Trajectory | None = None  # the rollout's, to store (OK / TIMEOUT / ERROR)
    error: str = ""  # why it failed: the dead letter's / error trajectory's text
    calls: list = field(default_factory=list)  # an agent error's calls so far
    trace_id: str = ""
    span_id: str = ""  # the failed attempt's rollout span


class Worker:
    """A rollout worker for one agent; any number of them share the agent's durable consumer."""

    def __init__(
        self,
        js: JetStreamContext,
        topo: Topology,
        agent: str,
        config: ConsumerSettings,
        env: RolloutEnv,
        limits: Limits | None = None,
    ) -> None:
        check_name(agent, "agent")
        self.js = js
        self.topo = topo
        self.agent = agent
        self.config = config
        self.env = env
        self.limits = limits or Limits()
        self.counters = Counters()
        self.metrics = RolloutMetrics(agent)
        self.store = OutcomeStore(js, topo, config.worker_id)
        self._inflight: dict[asyncio.Task, Msg] = {}
        self._stop = asyncio.Event()
        # Ends the heartbeat and registry loops. They are cancelled too, but a cancellation can
        # be lost inside nats-py's KV put (Python 3.11): the flag ends them at the next turn.
        self._quit_background = asyncio.Event()
        self._releasing: set[asyncio.Task] = set()  # jobs delivered as the worker stopped
        self._puller: JobPuller | None = None
        self.paused = False  # the pull loop waits for a fleet that is down
        # Set when the LLM fleet goes down or comes back: the registry shows it at once.
        self._registry_kick = asyncio.Event()
        for fleet in env.fleets:
            fleet.listeners.append(self._registry_kick.set)
            fleet.listeners.append(self._wake_puller)  # the pull loop pauses at once

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"<Worker {self.config.worker_id} agent={self.agent} in_flight={len(self._inflight)} "
            f"ok={c.ok} errors={c.errors} timeouts={c.timeouts} retried={c.retried} dead={c.dead_lettered}>"
        )

    @property
    def in_flight(self) -> int:
        return len(self._inflight)

    @property
    def ready(self) -> bool:
        """Bound to the agent's consumer and pulling (false before that and while draining)."""
        return self._puller is not None and not self._stop.is_set()

    def stop(self) -> None:
        """Begin draining (what SIGTERM does)."""
        self._stop.set()
        self._wake_puller()

    def _wake_puller(self) -> None:
        if self._puller is not None:
            self._puller.wake()

    # ---- main loop -------------------------------------------------------------------
    async def run(self) -> Counters:
        cfg = self.config
        consumer = self.topo.rollout_consumer_config(
            self.agent,
            self.limits,
            ack_wait_s=cfg.ack_wait_s,
            attempts=cfg.delivery.attempts,
            lost_deliveries=cfg.delivery.lost_deliveries,
        )
        await self._attach(consumer)
        log.info(
            "worker started",
            worker_id=cfg.worker_id,
            agent=self.agent,
            concurrency=cfg.concurrency,
            burst=cfg.burst,
            ack_wait_s=cfg.ack_wait_s,
            attempts=cfg.delivery.attempts,
            lost_deliveries=cfg.delivery.lost_deliveries,
        )
        background = [
            asyncio.create_task(self._heartbeat_loop()),
            asyncio.create_task(self._registry_loop()),
        ]
        try:
            await self._pull_loop()
            await self._drain()
        finally:
            self._quit_background.set()
            for task in background:
                task.cancel()
            _, stuck = await asyncio.wait(background, timeout=BACKGROUND_STOP_S)
            if stuck:  # never let a stuck informational loop keep the worker from stopping
                log.warning("background loop did not stop; left behind", tasks=len(stuck))
            await self._close_puller()  # before any nc.drain(): a live subscription hangs it
            await remove_worker(self.js, self.topo, cfg.worker_id)
            await self.store.close()
            log.info(
                "worker stopped",
                worker_id=cfg.worker_id,
                agent=self.agent,
                **asdict(self.counters),
            )
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
                await self._adopt_consumer_settings(consumer.durable_name)
                puller = JobPuller(
                    self.js,
                    self.topo.tasks_stream,
                    consumer.durable_name,
                    on_job=self._start,
                    capacity=self.config.concurrency,
                    max_batch=self.config.max_fetch,
                    expires_s=self.config.fetch_timeout_s,
                )
                await puller.start()
                self._puller = puller
                return
            except _ATTACH_RETRYABLE as exc:
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
        retry = self.config.delivery
        if max_deliver >= 2 and (
            max_deliver != retry.max_deliver or ack_wait != self.config.ack_wait_s
        ):
            # max_deliver = attempts + lost_deliveries + 1; one made by a release before lost
            # deliveries (max_deliver = attempts + 1) leaves no room for them: it is read so.
            lost = retry.lost_deliveries if max_deliver - 1 - retry.lost_deliveries >= 1 else 0
            adopted = replace(retry, attempts=max_deliver - 1 - lost, lost_deliveries=lost)
            log.warning(
                "the agent's consumer already exists with other settings: using them; change "
                "them with `agentarium broker init --agent NAME --attempts N --ack-wait S`",
                consumer=durable,
                attempts=adopted.attempts,
                lost_deliveries=adopted.lost_deliveries,
                ack_wait_s=ack_wait,
                flag_attempts=retry.attempts,
                flag_ack_wait_s=self.config.ack_wait_s,
            )
            self.config = replace(self.config, delivery=adopted, ack_wait_s=ack_wait)

    async def _pull_loop(self) -> None:
        """Keep a job on its way for every free slot (consumers/puller.py); jobs start as they
        arrive, in ``_start``."""
        cfg = self.config
        puller = self._puller
        assert puller is not None, "run() binds the puller (_attach) before the pull loop"
        errors_in_row = 0
        while not self._stop.is_set():
            held = [fleet for fleet in self.env.fleets if fleet.holding]
            if held:  # the fleet is down: take nothing new until it answers (or the limit)
                if cfg.burst and not self._inflight and await self._queue_empty():
                    return  # a burst with nothing left to do has no reason to wait for it
                self.paused = True
                await puller.close()  # the server drops the requests outstanding
                await self._wait_for_fleets(held)
                await puller.start()
                self.paused = False
                continue
            try:
                await puller.top_up(cfg.concurrency - len(self._inflight))
                errors_in_row = 0
            except (nats.errors.Error, OSError) as exc:
                errors_in_row += 1
                log.warning("pull request failed; retrying", error=str(exc) or type(exc).__name__)
                await self._sleep_or_stop(min(5.0, 0.1 * 2**errors_in_row))
                continue
            await puller.wait(cfg.fetch_timeout_s)
            if (
                cfg.burst
                and not self._inflight
                and time.monotonic() - puller.last_job_at >= cfg.fetch_timeout_s
                and await self._queue_empty()
            ):
                return
        await self._close_puller()  # the server drops the requests still outstanding

    def _start(self, msg: Msg) -> None:
        """Run one delivered job (the puller calls this for each)."""
        if self._stop.is_set():  # delivered as the worker stopped: released as a drain does
            released = Outcome(event=Event.RELEASED, error="released by a drain")
            task = asyncio.create_task(self._fall_back(msg, released))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            return
        self.counters.fetched += 1
        task = asyncio.create_task(self._handle(msg))
        self._inflight[task] = msg
        self.metrics.in_flight.inc()
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        del self._inflight[task]
        self.metrics.in_flight.dec()
        if self._puller is not None:
            self._puller.freed(self.config.concurrency - len(self._inflight))

    async def _close_puller(self) -> None:
        puller, self._puller = self._puller, None
        if puller is not None:
            try:
                await puller.close()
            except Exception:  # noqa: BLE001 - stopping: the connection may be gone already
                pass

    async def _wait_for_fleets(self, fleets: list) -> None:
        waits = [asyncio.create_task(self._stop.wait())]
        waits += [asyncio.create_task(fleet.wait_serving()) for fleet in fleets]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()

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
                self.topo.tasks_stream, self.topo.rollout_consumer(self.agent)
            )
        except (nats.errors.Error, nats.js.errors.Error):
            return False
        return not info.num_pending and not info.num_ack_pending

    async def _drain(self) -> None:
        if self._releasing:  # jobs that arrived as the worker stopped
            await asyncio.gather(*self._releasing, return_exceptions=True)
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
        while not await self._background_pause(period):
            for n, msg in enumerate(list(self._inflight.values()), 1):
                try:
                    await msg.in_progress()
                except (
                    Exception
                ) as exc:  # a lost heartbeat only risks a redelivery, which is handled
                    log.debug("heartbeat failed", error=str(exc))
                if n % HEARTBEAT_CHUNK == 0:  # tens of thousands in flight: let others run
                    await asyncio.sleep(0)

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
                "agent": self.agent,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "concurrency": cfg.concurrency,
                "in_flight": len(self._inflight),
                "started_at": started,
                "rollouts_per_s": round(rate, 2),
                "pulling": self.ready and not self.paused,
                **vars(self.counters),
            }
            if self.env.fleets:  # what `broker status` shows of the agent's LLM fleet
                info["fleet"] = fleets_summary(self.env.fleets)
            try:
                await publish_worker(self.js, self.topo, cfg.worker_id, info)
            except Exception as exc:  # registry is informational; never stop the worker for it
                log.debug("registry update failed", error=str(exc))
            if await self._background_pause(cfg.registry_interval_s, self._registry_kick):
                return
            self._registry_kick.clear()

    async def _background_pause(self, seconds: float, kick: asyncio.Event | None = None) -> bool:
        """Wait ``seconds`` (or until ``kick`` is set); True when the background loops must end."""
        waits = [asyncio.create_task(self._quit_background.wait())]
        if kick is not None:
            waits.append(asyncio.create_task(kick.wait()))
        try:
            await asyncio.wait(waits, timeout=seconds, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in waits:
                task.cancel()
        return self._quit_background.is_set()

    # ---- one message -------------------------------------------------------------------
    async def _handle(self, msg: Msg) -> None:
        try:
            await self._process(msg)
        except asyncio.CancelledError:
            await self._fall_back(msg, Outcome(event=Event.RELEASED, error="released by a drain"))
            raise
        except Exception as exc:
            await self._fall_back(msg, Outcome(event=Event.WORKER_ERROR, error=repr(exc)), exc)

    async def _process(self, msg: Msg) -> None:
        delivery = msg.metadata.num_delivered
        outcome = self._decode(msg)
        # A redelivery follows a failed run or a lost delivery: only the failures count.
        failures = 0
        if outcome.job is not None and delivery > 1:
            failures = await self.store.failures(outcome.job, delivery)
        decision = self.config.delivery.decide(outcome.event, delivery, failures)
        if decision.action is Action.RUN:
            assert outcome.job is not None  # RUN is only decided for a decoded job
            outcome = await self._run(msg, outcome.job, delivery, decision)
            decision = self.config.delivery.decide(outcome.event, delivery, failures)
        await self._settle(msg, decision, outcome, delivery, failures)

    def _decode(self, msg: Msg) -> Outcome:
        headers = msg.headers or {}
        try:
            job = decode(Job, msg.data, headers.get("Content-Type"))
        except SchemaError as exc:
            return Outcome(event=Event.INVALID_JOB, error=str(exc))
        if job.agent != self.topo.agent_of_subject(msg.subject):
            error = f"job.agent {job.agent!r} does not match its subject {msg.subject!r}"
            return Outcome(event=Event.WRONG_SUBJECT, job=job, error=error)
        return Outcome(event=Event.RECEIVED, job=job)

    async def _run(self, msg: Msg, job: Job, delivery: int, decision: Decision) -> Outcome:
        if decision.check_stored and await self.store.stored(job):
            return Outcome(event=Event.ALREADY_STORED, job=job)
        parent = extract_context(msg.headers or {})
        started = time.monotonic()
        try:
            trajectory = await run_rollout(
                job, self.env, attempt=delivery, parent=parent, subject=msg.subject
            )
        except EnvFailure as failure:
            self.metrics.rollout("env_unavailable", time.monotonic() - started)
            trajectory = failure.trajectory
            return Outcome(
                event=Event.ENV_UNAVAILABLE,
                job=job,
                trajectory=trajectory,
                error=trajectory.error or "",
                calls=list(trajectory.calls),
                trace_id=trajectory.trace_id,
                span_id=trajectory.span_id,
            )
        except AgentFailure as failure:
            self.metrics.rollout("agent_error", time.monotonic() - started)
            return Outcome(
                event=Event.AGENT_ERROR,
                job=job,
                error=failure.error,
                calls=failure.calls,
                trace_id=failure.trace_id,
                span_id=failure.span_id,
            )
        trajectory = self.store.fitted(trajectory)  # over max_payload: stored as an error
        event = Event(trajectory.status)  # ok / timeout / error
        self.metrics.rollout(trajectory.status, time.monotonic() - started)
        return Outcome(event=event, job=job, trajectory=trajectory, error=trajectory.error or "")

    async def _settle(
        self, msg: Msg, decision: Decision, outcome: Outcome, delivery: int, failures: int = 0
    ) -> None:
        """Carry out the decision: whatever must be stored first, then ack, nak or term."""
        job = outcome.job
        match decision.action:
            case Action.ACK:
                if outcome.trajectory is None:
                    self.counters.already_stored += 1
                    self.metrics.already_stored.inc()
                else:
                    await self._publish(outcome.trajectory)
                    self._count(outcome.trajectory)
                if outcome.event in (Event.ERROR, Event.ENV_UNAVAILABLE):
                    self.counters.failed += 1
                    log.warning(
                        "rollout failed",
                        job_id=job.job_id if job else "",
                        attempt=delivery,
                        status="error",
                        error=log_safe(outcome.error),
                    )
                await msg.ack()
            case Action.NAK:
                if outcome.event in (Event.AGENT_ERROR, Event.ENV_UNAVAILABLE):
                    self.counters.retried += 1
                    self.metrics.retries.inc()
                    log.warning(
                        "agent failed; retrying"
                        if outcome.event is Event.AGENT_ERROR
                        else "environment unavailable; retrying",
                        job_id=job.job_id if job else "",
                        attempt=failures + 1,
                        delivery=delivery,
                        delay_s=round(decision.delay_s, 2),
                        error=log_safe(outcome.error),
                    )
                if decision.count_failure and job is not None:
                    await self.store.count_failure(job, failures + 1)
                await msg.nak(delay=decision.delay_s or None)
            case Action.DEAD_LETTER:
                if outcome.event in (Event.INVALID_JOB, Event.WRONG_SUBJECT):
                    self.counters.invalid += 1
                error = outcome.error or decision.detail
                if decision.record_error and job is not None:
                    await self._record_error(job, outcome, error, delivery, decision)
                await self._dead_letter(
                    msg, reason=decision.reason, error=error, attempts=delivery, job=job
                )
            case _:
                raise AssertionError(f"cannot settle {decision}")

    async def _fall_back(
        self, msg: Msg, outcome: Outcome, exc: BaseException | None = None
    ) -> None:
        """Settle a delivery whose handling raised or was cancelled. Nothing may escape from
        here, and a job on its last delivery is terminated even when its dead letter cannot
        be written: a nak would strand it in the work queue forever."""
        delivery = msg.metadata.num_delivered
        decision = self.config.delivery.decide(outcome.event, delivery)
        if decision.action is Action.NAK:
            if exc is not None:
                log.error(
                    "unexpected error handling a job; releasing it for redelivery", exc_info=exc
                )
            await self._quietly(msg.nak(delay=decision.delay_s or None))
            return
        if exc is not None:
            log.error("unexpected error on a job's last delivery; terminating it", exc_info=exc)
        # A drain's grace is over already: the dead letter gets a short bound of its own.
        bound = RELEASE_DEAD_LETTER_S if outcome.event is Event.RELEASED else None
        try:
            async with asyncio.timeout(bound):
                await self.store.dead_letter(
                    msg.subject,
                    msg.data,
                    reason=decision.reason,
                    error=outcome.error,
                    attempts=delivery,
                )
            self.counters.dead_lettered += 1
            self.counters.failed += 1
            self.metrics.dead_letter(decision.reason)
        except Exception as letter_exc:  # noqa: BLE001 - the term() below must still happen
            log.error("dead letter failed too; the job is dropped", error=repr(letter_exc))
        await self._quietly(msg.term())

    async def _quietly(self, coro: Any) -> None:
        try:
            await coro
        except Exception as exc:
            log.warning("ack/nak failed; the job will be redelivered", error=str(exc))

    def _count(self, trajectory: Trajectory) -> None:
        self.counters.completed += 1
        if trajectory.status == "ok":
            self.counters.ok += 1
        elif trajectory.status == "timeout":
            self.counters.timeouts += 1
        else:
            self.counters.errors += 1

    async def _record_error(
        self, job: Job, outcome: Outcome, error: str, delivery: int, decision: Decision
    ) -> None:
        """Store the job's error trajectory, unless (``check_stored``) an earlier delivery did."""
        if decision.check_stored and await self.store.stored(job):
            return
        self.counters.completed += 1
        self.counters.errors += 1
        now = time.time()
        trajectory = trajectory_for(
            job,
            self.config.worker_id,
            status="error",
            error=error,
            attempts=delivery,
            started_at=now,
            finished_at=now,
            trace_id=outcome.trace_id,
            span_id=outcome.span_id,
            calls=outcome.calls,
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
