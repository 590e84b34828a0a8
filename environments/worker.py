"""The environment worker: one ``Environment`` class served as a NATS service, many sessions.

Rules (docs/design.md "Environment sessions"):
- A start (``<p>.env.<name>.start``, queue group ``<p>-env-<name>``) opens a session: one
  environment instance, reset with the task. The worker listens on the start subject only while
  it has room (open + starting < capacity, starting < max_starting, not draining):
  environments/admission.py.
- Every later request of a session goes to ``<p>.env.<name>.s.<worker>.<session>``: one
  wildcard subscription per worker, each request handled in its own task, one at a time per
  session (a lock). Steps carry ``seq``: the last seq again gets the stored reply (the step is
  never run twice), any other than the next is refused (409).
- Observations are capped (environments/caps.py). Idle sessions expire, a session's deadline is
  enforced (a step cut by it: 408), and every expiry closes the environment
  (environments/sessions.py).
- Nothing an environment raises stops the worker: that session gets a 500 and is closed.
- ``drain()`` (SIGTERM): no new sessions; open ones finish or expire, at most ``drain_grace_s``;
  then the worker unsubscribes and ``wait()`` returns.

This module answers requests (each one an ``environments.request.Request``); the modules above
hold the state they change.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from broker import Topology, round_trip
from schemas import (
    EnvCall,
    EnvStart,
    EnvStarted,
    EnvWorkerStats,
    Observation,
    Outcome,
    SchemaError,
    StepResult,
    decode,
)

from .admission import Admission
from .base import Environment, check_options
from .caps import TooLarge, cap_observation, cap_step_result
from .config import EnvWorkerConfig
from .metrics import EnvMetrics
from .request import Replier, ReplyTooLarge, Request, describe, error_code
from .service import Endpoint, EndpointCounters, EnvService, class_path
from .sessions import Session, SessionTable
from .stats import WorkerCounters

log = structlog.get_logger("agentarium.environments")

LOOP_STOP_S = 5.0  # how long stopping waits for the worker's own loops and requests


class EnvWorker:
    """Serves ``env_cls`` on ``topology``'s subjects: ``await start()``, then ``wait()``. Each
    session's instance is ``env_cls(**options)``; options it does not take are refused here."""

    def __init__(
        self,
        nc: Client,
        topology: Topology,
        env_cls: type[Environment],
        config: EnvWorkerConfig,
        options: dict[str, Any] | None = None,
    ) -> None:
        if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
            raise TypeError(f"{env_cls!r} is not a subclass of environments.Environment")
        self.options = check_options(env_cls, options or {})
        self.nc = nc
        self.topology = topology
        self.env_cls = env_cls
        self.config = config
        self.counters = WorkerCounters()
        self.metrics = EnvMetrics(config.name)  # the same figures for Prometheus
        self.start_subject = topology.env_start_subject(config.name)
        self.sessions_filter = topology.env_sessions_filter(config.name, config.worker_id)
        self.admission = Admission(
            nc,
            subject=self.start_subject,
            queue=topology.env_service(config.name),
            on_start=self._on_start,
            has_room=self._has_room,
            linger_s=config.start_linger_s,
            metrics=self.metrics,
            spawn=self._spawn,
        )
        self.sessions = SessionTable(
            config,
            self.counters,
            self.metrics,
            on_change=self.admission.changed,
            spawn=self._spawn,
        )
        self._replier = Replier(nc, self.counters, self.metrics)
        self._gate = asyncio.Semaphore(config.max_starting)
        self._session_sub: Subscription | None = None
        self._service: EnvService | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._draining = asyncio.Event()
        self._stopped = asyncio.Event()
        self._start_ep = Endpoint(
            "start", self.start_subject, topology.env_service(config.name), EndpointCounters()
        )
        self._session_ep = Endpoint("sessions", self.sessions_filter, "", EndpointCounters())

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"<EnvWorker {self.config.worker_id} env={self.config.name} "
            f"sessions={len(self.sessions)}/{self.config.capacity} starts={c.starts} "
            f"steps={c.steps} expired={c.expired} errors={c.errors}>"
        )

    # ---- state ---------------------------------------------------------------------------
    @property
    def open_sessions(self) -> int:
        return len(self.sessions)

    @property
    def accepting(self) -> bool:
        """Subscribed to the start subject right now."""
        return self.admission.accepting

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def ready(self) -> bool:
        return self._session_sub is not None and not self.draining and self.nc.is_connected

    def _has_room(self) -> bool:
        return (
            not self.draining
            and self.sessions.fits()
            and len(self.sessions.starting) < self.config.max_starting
        )

    def stats(self) -> EnvWorkerStats:
        c = self.counters
        p50, p99 = c.step_latency_ms()
        return EnvWorkerStats(
            worker=self.config.worker_id,
            env=self.config.name,
            sessions=len(self.sessions),
            capacity=self.config.capacity,
            starting=len(self.sessions.starting),
            max_starting=self.config.max_starting,
            starts=c.starts,
            starts_per_s=round(c.start_rate.rate(), 3),
            rejected=c.rejected,
            steps=c.steps,
            step_p50_ms=p50,
            step_p99_ms=p99,
            closed=c.closed,
            expired=c.expired,
            errors=c.errors,
            draining=self.draining,
            accepting=self.accepting,
        )

    # ---- lifecycle -----------------------------------------------------------------------
    async def start(self) -> EnvWorker:
        cfg = self.config
        max_payload = getattr(self.nc, "max_payload", 0) or 0
        if max_payload and cfg.max_observation_bytes >= max_payload:
            raise ValueError(
                f"max_observation_bytes {cfg.max_observation_bytes} is not below the server's "
                f"max_payload {max_payload}: lower --max-observation-bytes"
            )
        self._session_sub = await self.nc.subscribe(self.sessions_filter, cb=self._on_session)
        self._service = EnvService.for_worker(
            self.nc,
            self.topology,
            cfg,
            self.env_cls,
            endpoints=[self._start_ep, self._session_ep],
            custom_data=lambda: self.stats().to_wire(binary=False),
        )
        await self._service.start()
        # There is room at first: listen now, so the worker takes sessions once start() returns.
        await self.admission.subscribe()
        self.metrics.capacity.inc(cfg.capacity)
        await round_trip(self.nc)  # the server has every subscription once start() returns
        self.sessions.changed()
        self._loops = [
            asyncio.create_task(self.admission.run(), name="env-interest"),
            asyncio.create_task(self.sessions.janitor(self._stopped), name="env-janitor"),
        ]
        log.info(
            "environment worker started",
            **dataclasses.asdict(cfg),
            env_class=class_path(self.env_cls),
            start_subject=self.start_subject,
            sessions_subject=self.sessions_filter,
        )
        return self

    def drain(self) -> None:
        """Stop taking sessions (what SIGTERM does); ``wait()`` returns once they are gone."""
        if not self.draining:
            log.info("environment worker draining", open_sessions=len(self.sessions))
            self._draining.set()
            self.sessions.changed()

    async def wait(self) -> WorkerCounters:
        """Until drained: open sessions finish or expire, at most ``drain_grace_s``."""
        await self._draining.wait()
        try:
            if not self.sessions.empty.is_set():
                await asyncio.wait_for(self.sessions.empty.wait(), self.config.drain_grace_s)
        except TimeoutError:
            log.warning("drain grace over: closing the sessions left", sessions=len(self.sessions))
            await self.sessions.expire_all()
        await self._shutdown()
        return self.counters

    async def stop(self, grace_s: float | None = None) -> WorkerCounters:
        """Drain, with ``grace_s`` instead of the configured grace; never raises."""
        if grace_s is not None:
            self.config = dataclasses.replace(self.config, drain_grace_s=grace_s)
        self.drain()
        return await self.wait()

    async def _shutdown(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self.admission.stop()  # ends on the flag (see Admission.run)
        self._loops[-1].cancel()  # the janitor, asleep: a plain sleep takes the cancel
        _, stuck = await asyncio.wait(self._loops, timeout=LOOP_STOP_S)
        for task in stuck:
            task.cancel()
        self.metrics.capacity.dec(self.config.capacity)
        await self.admission.close()
        if self._session_sub is not None:
            with contextlib.suppress(Exception):
                await self._session_sub.unsubscribe()
        self._session_sub = None
        if self._service is not None:
            with contextlib.suppress(Exception):
                await self._service.stop()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(list(self._tasks), timeout=LOOP_STOP_S)
        log.info("environment worker stopped", **dataclasses.asdict(self.stats()))

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- starts --------------------------------------------------------------------------
    async def _on_start(self, msg: Msg) -> None:
        """Decide at once (this callback runs one message at a time); the reset runs in a task."""
        req = self._replier.request(msg, self._start_ep)
        try:
            start = decode(EnvStart, msg.data, req.content_type)
        except SchemaError as exc:
            await req.error(400, f"not a valid EnvStart: {exc}")
            return
        existing = self.sessions.get(start.session_id)
        if existing is not None:  # a retried start whose answer was lost: the same answer
            await req.reply(existing.started_reply)
            return
        still_starting = start.session_id in self.sessions.starting
        if self.draining or still_starting or not self.sessions.fits():
            self.counters.rejected += 1
            self.metrics.rejected.inc()
            why = "draining" if self.draining else "full"
            if still_starting:
                why = "this session is still starting"
            await req.error(503, f"worker {self.config.worker_id}: {why}")
            return
        self.sessions.begin(start.session_id)
        self._spawn(self._start_session(req, start))

    async def _start_session(self, req: Request, start: EnvStart) -> None:
        env: Environment | None = None
        try:
            async with self._gate:
                env = self.env_cls(**self.options)
                deadline_at = time.monotonic() + start.deadline_s
                async with asyncio.timeout(start.deadline_s):
                    observation = await env.reset(start.task)
                if not isinstance(observation, Observation):
                    raise TypeError(
                        f"{self.env_cls.__qualname__}.reset returned "
                        f"{type(observation).__name__}, not an Observation"
                    )
                observation = cap_observation(observation, self.config.max_observation_bytes)
        except TimeoutError:
            await self._start_failed(req, start, env, 408, "reset ran past its deadline")
            return
        except Exception as exc:  # noqa: BLE001 - an environment's bug must not stop the worker
            # The task itself is wrong (an unknown index, a missing field): 400, not retryable.
            bad_task = isinstance(exc, (ValueError, LookupError)) and not isinstance(exc, TooLarge)
            code = error_code(exc, 400 if bad_task else 500)
            if code == 500:
                log.warning("environment reset raised", session=start.session_id, exc_info=True)
            what = "bad task" if code == 400 else "reset raised"
            await self._start_failed(req, start, env, code, f"{what}: {describe(exc)}")
            return
        started = EnvStarted(
            session_id=start.session_id,
            worker=self.config.worker_id,
            subject=self.topology.env_session_subject(
                self.config.name, self.config.worker_id, start.session_id
            ),
            observation=observation,
            idle_timeout_s=self.config.idle_timeout_s,
        )
        reply = req.encode(started)
        if over := req.too_large(reply):
            await self._start_failed(req, start, env, 500, over)
            return
        session = Session(
            session_id=start.session_id,
            env=env,
            deadline_at=deadline_at,
            last_active=time.monotonic(),
            started_reply=reply,
            job_id=start.job_id,
        )
        self.sessions.add(session)
        self.counters.starts += 1
        self.counters.start_rate.add()
        self.metrics.starts.inc()
        await req.reply(reply)

    async def _start_failed(
        self, req: Request, start: EnvStart, env: Environment | None, code: int, message: str
    ) -> None:
        self.counters.start_failures += 1
        if code == 500:
            self.counters.errors += 1
            self.metrics.errors.inc()
        if env is not None:  # release what the reset may have taken
            await self.sessions.close_env(env, "start failed", start.session_id)
        self.sessions.abandon(start.session_id)
        await req.error(code, message)

    # ---- session requests ----------------------------------------------------------------
    async def _on_session(self, msg: Msg) -> None:
        self._spawn(self._handle_call(self._replier.request(msg, self._session_ep)))

    async def _handle_call(self, req: Request) -> None:
        msg = req.msg
        session_id = msg.subject.rsplit(".", 1)[-1]
        if len(msg.data) > self.config.max_request_bytes:
            await req.error(
                413,
                f"request of {len(msg.data)} bytes is over this worker's limit of "
                f"{self.config.max_request_bytes}",
            )
            return
        try:
            call = decode(EnvCall, msg.data, req.content_type)
        except SchemaError as exc:
            await req.error(400, f"not a valid EnvCall: {exc}")
            return
        session = self.sessions.get(session_id)
        if session is None:
            await self._gone(req, session_id, call)
            return
        async with session.lock:
            if session.closed:
                await self._gone(req, session_id, call)
                return
            session.last_active = time.monotonic()
            if call.op == "close":
                await self._close(session, req)
            else:
                await self._step(session, req, call)
            session.last_active = time.monotonic()

    async def _step(self, session: Session, req: Request, call: EnvCall) -> None:
        if call.seq == session.last_seq and session.last_reply is not None:
            await req.reply(session.last_reply)  # a retry: never run twice
            return
        if call.seq != session.last_seq + 1:
            await req.error(
                409,
                f"session {session.session_id}: expected seq {session.last_seq + 1} (or "
                f"{session.last_seq} again), got {call.seq}",
            )
            return
        remaining = session.deadline_at - time.monotonic()
        try:
            async with asyncio.timeout(max(0.0, remaining)) as limit:
                result = await session.env.step(call.message)
            if not isinstance(result, StepResult):
                raise TypeError(
                    f"{self.env_cls.__qualname__}.step returned {type(result).__name__}, "
                    "not a StepResult"
                )
            result = dataclasses.replace(result, seq=call.seq)
            result = cap_step_result(result, self.config.max_observation_bytes)
        except TimeoutError as exc:
            if not limit.expired():
                await self._step_raised(session, req, exc)
                return
            await self.sessions.end(session, "its deadline passed during a step", expired=True)
            await req.error(408, f"session {session.session_id}: its deadline passed")
            return
        except Exception as exc:  # noqa: BLE001 - an environment's bug must not stop the worker
            await self._step_raised(session, req, exc)
            return
        reply = req.encode(result)
        if over := req.too_large(reply):
            await self._step_raised(session, req, ReplyTooLarge(over))
            return
        session.last_seq, session.last_reply = call.seq, reply
        session.steps += 1
        seconds = (time.perf_counter_ns() - req.began) / 1e9
        self.counters.steps += 1
        self.counters.latencies_s.append(seconds)
        self.metrics.steps.inc()
        self.metrics.step_seconds.observe(seconds)
        await req.reply(reply)

    async def _step_raised(self, session: Session, req: Request, exc: BaseException) -> None:
        log.warning(
            "environment step raised; session closed",
            session=session.session_id,
            job_id=session.job_id,
            exc_info=exc,
        )
        self.counters.errors += 1
        self.metrics.errors.inc()
        await self.sessions.end(session, "the environment raised during a step")
        await req.error(
            error_code(exc, 500),
            f"session {session.session_id}: step raised {describe(exc)}; the session is closed",
        )

    async def _close(self, session: Session, req: Request) -> None:
        session.closed = True
        try:
            outcome = await asyncio.wait_for(session.env.close(), self.config.close_timeout_s)
            if not isinstance(outcome, Outcome):
                raise TypeError(
                    f"{self.env_cls.__qualname__}.close returned {type(outcome).__name__}, "
                    "not an Outcome"
                )
            reply = req.encode(dataclasses.replace(outcome, steps=session.steps))
            if over := req.too_large(reply):
                raise ReplyTooLarge(over)
        except Exception as exc:  # noqa: BLE001
            log.warning("environment close failed", session=session.session_id, exc_info=exc)
            self.counters.errors += 1
            self.metrics.errors.inc()
            if isinstance(exc, ReplyTooLarge):
                detail = f"its outcome cannot be sent: {exc}"
            else:
                detail = f"close raised {describe(exc)}"
            error = (error_code(exc, 500), f"session {session.session_id}: {detail}")
            self.sessions.forget(session, f"closed; {detail}", error=error)
            await req.error(*error)
            return
        self.counters.closed += 1
        self.metrics.closed.inc()
        self.sessions.forget(session, "closed", reply)
        await req.reply(reply)

    async def _gone(self, req: Request, session_id: str, call: EnvCall) -> None:
        tomb = self.sessions.tombstones.get(session_id)
        if tomb is not None and call.op == "close" and tomb.reply is not None:
            await req.reply(tomb.reply)  # a retried close
            return
        if tomb is not None and call.op == "close" and tomb.error is not None:
            await req.error(*tomb.error)  # the same failure
            return
        why = (
            f"session {session_id} ended here: {tomb.reason}"
            if tomb is not None
            else f"no session {session_id} on worker {self.config.worker_id}: expired, closed, "
            "or its worker restarted"
        )
        await req.error(404, why)
