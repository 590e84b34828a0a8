"""The environment worker: one ``Environment`` class served as a NATS service, many sessions.

Rules (docs/design.md "Environment sessions"):
- A start (``<p>.env.<name>.start``, queue group ``<p>-env-<name>``) opens a session: one
  environment instance, reset with the task. The worker listens on the start subject only while
  it has room (open + starting < capacity, starting < max_starting, not draining):
  environments/admission.py.
- Every later request of a session goes to ``<p>.env.<name>.s.<worker>.<session>``: one
  wildcard subscription per worker, each request handled in its own task, one at a time per
  session (a lock), by environments/calls.py. Steps carry ``seq``: the last seq again gets the
  stored reply (the step is never run twice), any other than the next is refused (409).
- Observations are capped (environments/caps.py). Idle sessions expire, a session's deadline is
  enforced (a step cut by it: 408), and every expiry closes the environment
  (environments/sessions.py).
- Nothing an environment raises stops the worker: that session gets a 500 and is closed.
- ``drain()`` (SIGTERM): no new sessions; open ones finish or expire, at most ``drain_grace_s``;
  then the worker unsubscribes and ``wait()`` returns.

This module holds the lifecycle and answers starts; every answer goes through an
``environments.request.Request`` (the message, its endpoint, when it began).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import time
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from agentarium.broker import Topology, continue_trace, round_trip
from agentarium.schemas import (
    EnvStart,
    EnvStarted,
    EnvWorkerStats,
    Observation,
    SchemaError,
    decode,
)

from .admission import Admission
from .base import Environment, check_options
from .calls import SessionCalls
from .caps import TooLarge, cap_observation
from .config import EnvWorkerConfig
from .metrics import EnvMetrics
from .request import Replier, Request, describe, error_code
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
        if not config.name:
            raise ValueError("EnvWorkerConfig.name is empty: name the environment it serves")
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
        self.calls = SessionCalls(
            config, env_cls.__qualname__, self.sessions, self.counters, self.metrics
        )
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
        # The host first (a refusal is a ValueError, like a bad setting): nothing subscribed yet.
        await asyncio.to_thread(self.env_cls.preflight, dict(self.options))
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

    def _spawn(self, coro: Any, headers: dict[str, str] | None = None) -> None:
        """Run ``coro`` in its own task, under the trace of the request whose NATS ``headers``
        carry a ``traceparent`` (the rollout's ``env.*`` span): what the environment does,
        an HTTP call to a task worker included, joins the rollout's trace."""
        context = None
        if headers and "traceparent" in headers:
            context = contextvars.copy_context()
            context.run(continue_trace, headers)  # the task's own copy: never detached
        task = asyncio.create_task(coro, context=context)
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
        self._spawn(self._start_session(req, start), msg.headers)

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

    async def _on_session(self, msg: Msg) -> None:
        """Each session request in its own task: sessions step concurrently."""
        self._spawn(self.calls.handle(self._replier.request(msg, self._session_ep)), msg.headers)
