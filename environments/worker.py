"""The environment worker: one ``Environment`` class served as a NATS service, many sessions.

Rules (docs/design.md "Environment sessions"):
- A start (``<p>.env.<name>.start``, queue group ``<p>-env-<name>``) opens a session: one
  environment instance, reset with the task. The worker listens on the start subject only while
  it has room (open + starting < capacity, starting < max_starting, not draining): NATS never
  re-routes a declined queue request, so a full worker unsubscribes (a drain: what the server
  already routed here is answered, 503 when it no longer fits) and subscribes again when a slot
  frees. A start finding no worker with room gets no-responders; the client backs off.
- Every later request of a session goes to ``<p>.env.<name>.s.<worker>.<session>``: one
  wildcard subscription per worker, each request handled in its own task, one at a time per
  session (a lock). Steps carry ``seq``: the last seq again gets the stored reply (the step is
  never run twice), any other than the next is refused (409).
- Observations are capped (environments/caps.py). Idle sessions expire, a session's deadline is
  enforced (a step cut by it: 408), and every expiry closes the environment.
- Nothing an environment raises stops the worker: that session gets a 500 and is closed.
- ``drain()`` (SIGTERM): no new sessions; open ones finish or expire, at most ``drain_grace_s``;
  then the worker unsubscribes and ``wait()`` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import inspect
import time
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from broker import Topology, round_trip
from schemas import (
    ENV_ERROR_CODES,
    EnvCall,
    EnvError,
    EnvStart,
    EnvStarted,
    EnvWorkerStats,
    Observation,
    Outcome,
    SchemaError,
    StepResult,
    decode,
    encode,
    encode_json,
)

from .base import Environment
from .caps import TooLarge, cap_observation, cap_step_result
from .config import EnvWorkerConfig, Session, Tombstone, agentarium_version
from .metrics import EnvMetrics
from .service import KIND, Endpoint, EndpointCounters, EnvService
from .stats import WorkerCounters

log = structlog.get_logger("agentarium.environments")

LOOP_STOP_S = 5.0  # how long stopping waits for the worker's own loops and requests
REPLY_HEADROOM = 1024  # room under max_payload for the reply's subject and headers


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
        self._sessions: dict[str, Session] = {}
        self._starting: set[str] = set()
        self._tombstones: dict[str, Tombstone] = {}
        self._gate = asyncio.Semaphore(config.max_starting)
        self._start_sub: Subscription | None = None
        self._session_sub: Subscription | None = None
        self._service: EnvService | None = None
        self._tasks: set[asyncio.Task] = set()
        self._loops: list[asyncio.Task] = []
        self._interest = asyncio.Event()
        self._empty = asyncio.Event()
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
            f"sessions={len(self._sessions)}/{self.config.capacity} starts={c.starts} "
            f"steps={c.steps} expired={c.expired} errors={c.errors}>"
        )

    # ---- state ---------------------------------------------------------------------------
    @property
    def open_sessions(self) -> int:
        return len(self._sessions)

    @property
    def accepting(self) -> bool:
        """Subscribed to the start subject right now."""
        return self._start_sub is not None

    @property
    def draining(self) -> bool:
        return self._draining.is_set()

    @property
    def ready(self) -> bool:
        return self._session_sub is not None and not self.draining and self.nc.is_connected

    def _has_room(self) -> bool:
        c = self.config
        return (
            not self.draining
            and len(self._sessions) + len(self._starting) < c.capacity
            and len(self._starting) < c.max_starting
        )

    def _changed(self) -> None:
        """Sessions or starts changed: reconsider the start subscription."""
        self._interest.set()
        if not self._sessions and not self._starting:
            self._empty.set()
        else:
            self._empty.clear()

    def stats(self) -> EnvWorkerStats:
        c = self.counters
        p50, p99 = c.step_latency_ms()
        return EnvWorkerStats(
            worker=self.config.worker_id,
            env=self.config.name,
            sessions=len(self._sessions),
            capacity=self.config.capacity,
            starting=len(self._starting),
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
        self._service = EnvService(
            self.nc,
            name=self.topology.env_service(cfg.name),
            worker_id=cfg.worker_id,
            version=agentarium_version(),
            description=f"agentarium environment {cfg.name} ({self.env_cls.__qualname__})",
            metadata={
                "kind": KIND,
                "prefix": self.topology.prefix,
                "env": cfg.name,
                "worker": cfg.worker_id,
                "class": f"{self.env_cls.__module__}:{self.env_cls.__qualname__}",
            },
            endpoints=[self._start_ep, self._session_ep],
            custom_data=lambda: self.stats().to_wire(binary=False),
        )
        await self._service.start()
        # There is room at first: listen now, so the worker takes sessions once start() returns.
        self._start_sub = await self.nc.subscribe(
            self.start_subject, queue=self.topology.env_service(cfg.name), cb=self._on_start
        )
        self.metrics.accepting.inc()
        self.metrics.capacity.inc(cfg.capacity)
        await round_trip(self.nc)  # the server has every subscription once start() returns
        self._changed()
        self._loops = [
            asyncio.create_task(self._interest_loop(), name="env-interest"),
            asyncio.create_task(self._janitor_loop(), name="env-janitor"),
        ]
        log.info(
            "environment worker started",
            **{k: v for k, v in dataclasses.asdict(cfg).items()},
            env_class=f"{self.env_cls.__module__}:{self.env_cls.__qualname__}",
            start_subject=self.start_subject,
            sessions_subject=self.sessions_filter,
        )
        return self

    def drain(self) -> None:
        """Stop taking sessions (what SIGTERM does); ``wait()`` returns once they are gone."""
        if not self.draining:
            log.info("environment worker draining", open_sessions=len(self._sessions))
            self._draining.set()
            self._changed()

    async def wait(self) -> WorkerCounters:
        """Until drained: open sessions finish or expire, at most ``drain_grace_s``."""
        await self._draining.wait()
        try:
            if not self._empty.is_set():
                await asyncio.wait_for(self._empty.wait(), self.config.drain_grace_s)
        except TimeoutError:
            left = list(self._sessions.values())
            log.warning("drain grace over: closing the sessions left", sessions=len(left))
            await asyncio.gather(*(self._expire(s, "drain") for s in left))
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
        # The loops end on the flag, not by cancellation: Python 3.11's wait_for (inside
        # nats-py's flush, inside a subscription's drain) can swallow a cancel.
        self._interest.set()
        self._loops[-1].cancel()  # the janitor, asleep: a plain sleep takes the cancel
        _, stuck = await asyncio.wait(self._loops, timeout=LOOP_STOP_S)
        for task in stuck:
            task.cancel()
        if self._start_sub is not None:
            self.metrics.accepting.dec()
        self.metrics.capacity.dec(self.config.capacity)
        for sub in (self._start_sub, self._session_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._start_sub = self._session_sub = None
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

    # ---- the start subscription ---------------------------------------------------------
    async def _interest_loop(self) -> None:
        while not self._stopped.is_set():
            await self._interest.wait()
            self._interest.clear()
            if self._stopped.is_set():
                return
            try:
                await self._follow_room()
            except Exception:  # noqa: BLE001 - e.g. a reconnect under way: try again shortly
                log.warning("could not change the start subscription; retrying", exc_info=True)
                await asyncio.sleep(0.5)
                self._interest.set()

    async def _follow_room(self) -> None:
        want = self._has_room()
        if want and self._start_sub is None:
            self._start_sub = await self.nc.subscribe(
                self.start_subject,
                queue=self.topology.env_service(self.config.name),
                cb=self._on_start,
            )
            self.metrics.accepting.inc()
        elif not want and self._start_sub is not None:
            sub, self._start_sub = self._start_sub, None
            self.metrics.accepting.dec()
            # UNSUB and a round trip, as nats-py's drain does (but one whose PONG follows the
            # UNSUB: broker.round_trip); the subscription keeps its callback a while longer
            # (_linger): nats-server can deliver a start it routed here before the UNSUB after
            # the worker's round trip (seen 60 ms late on a loaded machine, with nats-py's
            # flush, whose PING overtook the UNSUB), and nats-py drops a message whose
            # subscription is gone, so its client would wait for its request timeout (60 s)
            # instead of an answer. nats-py has no public call that sends the UNSUB and keeps
            # the subscription.
            self._spawn(self._linger(sub))  # first: drained in the end even if this fails
            await self.nc._send_unsubscribe(sub._id)
            await round_trip(self.nc)

    async def _linger(self, sub: Subscription) -> None:
        """Answer what still comes on a start subscription after its UNSUB, then drop it."""
        try:
            await asyncio.sleep(self.config.start_linger_s)
        finally:
            with contextlib.suppress(Exception):
                await sub.drain()  # a late start being answered now finishes first

    async def _on_start(self, msg: Msg) -> None:
        """Decide at once (this callback runs one message at a time); the reset runs in a task."""
        began = time.perf_counter_ns()
        try:
            start = decode(EnvStart, msg.data, (msg.headers or {}).get("Content-Type"))
        except SchemaError as exc:
            await self._error(msg, 400, f"not a valid EnvStart: {exc}", self._start_ep, began)
            return
        existing = self._sessions.get(start.session_id)
        if existing is not None:  # a retried start whose answer was lost: the same answer
            await self._reply(msg, existing.started_reply, self._start_ep, began)
            return
        if self.draining or start.session_id in self._starting or not self._fits():
            self.counters.rejected += 1
            self.metrics.rejected.inc()
            why = "draining" if self.draining else "full"
            if start.session_id in self._starting:
                why = "this session is still starting"
            await self._error(
                msg, 503, f"worker {self.config.worker_id}: {why}", self._start_ep, began
            )
            return
        self._starting.add(start.session_id)
        self._changed()
        self._spawn(self._start_session(msg, start, began))

    def _fits(self) -> bool:
        return len(self._sessions) + len(self._starting) < self.config.capacity

    async def _start_session(self, msg: Msg, start: EnvStart, began: int) -> None:
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
            await self._start_failed(msg, start, env, 408, "reset ran past its deadline", began)
            return
        except Exception as exc:  # noqa: BLE001 - an environment's bug must not stop the worker
            # The task itself is wrong (an unknown index, a missing field): 400, not retryable.
            bad_task = isinstance(exc, (ValueError, LookupError)) and not isinstance(exc, TooLarge)
            code = error_code(exc, 400 if bad_task else 500)
            if code == 500:
                log.warning("environment reset raised", session=start.session_id, exc_info=True)
            what = "bad task" if code == 400 else "reset raised"
            await self._start_failed(msg, start, env, code, f"{what}: {_describe(exc)}", began)
            return
        now = time.monotonic()
        started = EnvStarted(
            session_id=start.session_id,
            worker=self.config.worker_id,
            subject=self.topology.env_session_subject(
                self.config.name, self.config.worker_id, start.session_id
            ),
            observation=observation,
            idle_timeout_s=self.config.idle_timeout_s,
        )
        reply = _encode_like(msg, started)
        if over := self._over_max_payload(reply):
            await self._start_failed(msg, start, env, 500, over, began)
            return
        self._sessions[start.session_id] = Session(
            session_id=start.session_id,
            env=env,
            deadline_at=deadline_at,
            last_active=now,
            started_reply=reply,
            job_id=start.job_id,
        )
        self._starting.discard(start.session_id)
        self.counters.starts += 1
        self.counters.start_rate.add()
        self.metrics.sessions.inc()
        self.metrics.starts.inc()
        self._changed()
        await self._reply(msg, reply, self._start_ep, began)

    async def _start_failed(
        self,
        msg: Msg,
        start: EnvStart,
        env: Environment | None,
        code: int,
        message: str,
        began: int,
    ) -> None:
        self.counters.start_failures += 1
        if code == 500:
            self.counters.errors += 1
            self.metrics.errors.inc()
        if env is not None:  # release what the reset may have taken
            await self._close_env(env, "start failed", start.session_id)
        self._starting.discard(start.session_id)
        self._changed()
        await self._error(msg, code, message, self._start_ep, began)

    # ---- session requests ----------------------------------------------------------------
    async def _on_session(self, msg: Msg) -> None:
        self._spawn(self._handle_call(msg))

    async def _handle_call(self, msg: Msg) -> None:
        began = time.perf_counter_ns()
        ep = self._session_ep
        session_id = msg.subject.rsplit(".", 1)[-1]
        if len(msg.data) > self.config.max_request_bytes:
            await self._error(
                msg,
                413,
                f"request of {len(msg.data)} bytes is over this worker's limit of "
                f"{self.config.max_request_bytes}",
                ep,
                began,
            )
            return
        try:
            call = decode(EnvCall, msg.data, (msg.headers or {}).get("Content-Type"))
        except SchemaError as exc:
            await self._error(msg, 400, f"not a valid EnvCall: {exc}", ep, began)
            return
        session = self._sessions.get(session_id)
        if session is None:
            await self._gone(msg, session_id, call, began)
            return
        async with session.lock:
            if session.closed:
                await self._gone(msg, session_id, call, began)
                return
            session.last_active = time.monotonic()
            if call.op == "close":
                await self._close(session, msg, began)
            else:
                await self._step(session, msg, call, began)
            session.last_active = time.monotonic()

    async def _step(self, session: Session, msg: Msg, call: EnvCall, began: int) -> None:
        ep = self._session_ep
        if call.seq == session.last_seq and session.last_reply is not None:
            await self._reply(msg, session.last_reply, ep, began)  # a retry: never run twice
            return
        if call.seq != session.last_seq + 1:
            await self._error(
                msg,
                409,
                f"session {session.session_id}: expected seq {session.last_seq + 1} (or "
                f"{session.last_seq} again), got {call.seq}",
                ep,
                began,
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
                await self._step_raised(session, msg, exc, began)
                return
            await self._end(session, "its deadline passed during a step", expired=True)
            await self._error(
                msg, 408, f"session {session.session_id}: its deadline passed", ep, began
            )
            return
        except Exception as exc:  # noqa: BLE001 - an environment's bug must not stop the worker
            await self._step_raised(session, msg, exc, began)
            return
        reply = _encode_like(msg, result)
        if over := self._over_max_payload(reply):
            await self._step_raised(session, msg, ReplyTooLarge(over), began)
            return
        session.last_seq, session.last_reply = call.seq, reply
        session.steps += 1
        seconds = (time.perf_counter_ns() - began) / 1e9
        self.counters.steps += 1
        self.counters.latencies_s.append(seconds)
        self.metrics.steps.inc()
        self.metrics.step_seconds.observe(seconds)
        await self._reply(msg, reply, ep, began)

    async def _step_raised(
        self, session: Session, msg: Msg, exc: BaseException, began: int
    ) -> None:
        log.warning(
            "environment step raised; session closed",
            session=session.session_id,
            job_id=session.job_id,
            exc_info=exc,
        )
        self.counters.errors += 1
        self.metrics.errors.inc()
        await self._end(session, "the environment raised during a step")
        await self._error(
            msg,
            error_code(exc, 500),
            f"session {session.session_id}: step raised {_describe(exc)}; the session is closed",
            self._session_ep,
            began,
        )

    async def _close(self, session: Session, msg: Msg, began: int) -> None:
        session.closed = True
        try:
            outcome = await asyncio.wait_for(session.env.close(), self.config.close_timeout_s)
            if not isinstance(outcome, Outcome):
                raise TypeError(
                    f"{self.env_cls.__qualname__}.close returned {type(outcome).__name__}, "
                    "not an Outcome"
                )
            reply = _encode_like(msg, dataclasses.replace(outcome, steps=session.steps))
            if over := self._over_max_payload(reply):
                raise ReplyTooLarge(over)
        except Exception as exc:  # noqa: BLE001
            log.warning("environment close failed", session=session.session_id, exc_info=exc)
            self.counters.errors += 1
            self.metrics.errors.inc()
            if isinstance(exc, ReplyTooLarge):
                detail = f"its outcome cannot be sent: {exc}"
            else:
                detail = f"close raised {_describe(exc)}"
            error = (error_code(exc, 500), f"session {session.session_id}: {detail}")
            self._forget(session, f"closed; {detail}", error=error)
            await self._error(msg, *error, self._session_ep, began)
            return
        self.counters.closed += 1
        self.metrics.closed.inc()
        self._forget(session, "closed", reply)
        await self._reply(msg, reply, self._session_ep, began)

    async def _gone(self, msg: Msg, session_id: str, call: EnvCall, began: int) -> None:
        tomb = self._tombstones.get(session_id)
        if tomb is not None and call.op == "close" and tomb.reply is not None:
            await self._reply(msg, tomb.reply, self._session_ep, began)  # a retried close
            return
        if tomb is not None and call.op == "close" and tomb.error is not None:
            await self._error(msg, *tomb.error, self._session_ep, began)  # the same failure
            return
        why = (
            f"session {session_id} ended here: {tomb.reason}"
            if tomb is not None
            else f"no session {session_id} on worker {self.config.worker_id}: expired, closed, "
            "or its worker restarted"
        )
        await self._error(msg, 404, why, self._session_ep, began)

    # ---- ending sessions -----------------------------------------------------------------
    async def _end(self, session: Session, reason: str, *, expired: bool = False) -> None:
        """Close the environment of a session that ends without its client's close."""
        session.closed = True
        if expired:
            self.counters.expired += 1
            self.metrics.expired.inc()
        await self._close_env(session.env, reason, session.session_id)
        self._forget(session, reason)

    def _forget(
        self,
        session: Session,
        reason: str,
        reply: bytes | None = None,
        *,
        error: tuple[int, str] | None = None,
    ) -> None:
        session.closed = True
        if self._sessions.pop(session.session_id, None) is not None:
            self.metrics.sessions.dec()
        until = time.monotonic() + self.config.closed_memory_s
        self._tombstones[session.session_id] = Tombstone(until, reason, reply, error)
        self._changed()

    async def _close_env(self, env: Environment, reason: str, session_id: str = "") -> None:
        try:
            await asyncio.wait_for(env.close(), self.config.close_timeout_s)
        except Exception:  # noqa: BLE001 - ending anyway: log and let go
            log.warning(
                "environment close raised", session=session_id, reason=reason, exc_info=True
            )

    async def _expire(self, session: Session, why: str) -> None:
        async with session.lock:
            session.expiring = False
            now = time.monotonic()
            still = {
                "idle": now - session.last_active >= self.config.idle_timeout_s,
                "deadline": now >= session.deadline_at,
                "drain": True,
            }
            if session.closed or not still[why]:  # a request came in meanwhile
                return
            reasons = {
                "idle": f"expired: idle for more than {self.config.idle_timeout_s:g} s",
                "deadline": "expired: its deadline passed",
                "drain": "closed by the worker's drain (SIGTERM)",
            }
            log.info("session expired", session=session.session_id, why=why)
            await self._end(session, reasons[why], expired=True)

    async def _janitor_loop(self) -> None:
        while not self._stopped.is_set():
            await asyncio.sleep(self.config.janitor_interval_s)
            self._sweep()

    def _sweep(self) -> None:
        """Expire idle sessions and those past their deadline; forget old tombstones."""
        now = time.monotonic()
        for session in list(self._sessions.values()):
            if session.lock.locked() or session.expiring:
                continue  # a step is running (its own deadline bounds it), or already going
            if now >= session.deadline_at:
                session.expiring = True
                self._spawn(self._expire(session, "deadline"))
            elif now - session.last_active >= self.config.idle_timeout_s:
                session.expiring = True
                self._spawn(self._expire(session, "idle"))
        for session_id, tomb in list(self._tombstones.items()):
            if tomb.until <= now:
                del self._tombstones[session_id]

    # ---- replies -------------------------------------------------------------------------
    def _over_max_payload(self, reply: bytes) -> str:
        """Why a reply cannot be sent ("" when it can): nats-server refuses a message over its
        max_payload, and the client would only see its request time out. The observation cap
        is measured on msgpack; a JSON reply (control characters escaped) or an outcome's
        ``info`` (not capped) can still exceed the server's limit."""
        limit = self.nc.max_payload
        if limit and len(reply) > limit - REPLY_HEADROOM:
            return (
                f"the reply is {len(reply)} bytes, over the server's max_payload of {limit} "
                "(lower the worker's --max-observation-bytes, or keep the outcome's info small)"
            )
        return ""

    async def _reply(self, msg: Msg, data: bytes, ep: Endpoint, began: int) -> None:
        ep.counters.record(began)
        if msg.reply:
            await self.nc.publish(msg.reply, data)

    async def _error(self, msg: Msg, code: int, message: str, ep: Endpoint, began: int) -> None:
        name = ENV_ERROR_CODES[code]
        ep.counters.record(began, f"{code} {name}: {message}"[:300])
        self.metrics.refused(code)
        if code in (400, 404, 408, 409, 413):
            self.counters.bad_requests += 1
        if not msg.reply:
            return
        error = EnvError(code=code, error=name, message=message)
        header = " ".join(message.split())[:512]  # header values hold no line breaks
        await self.nc.publish(
            msg.reply,
            _encode_like(msg, error),
            headers={"Nats-Service-Error": header, "Nats-Service-Error-Code": str(code)},
        )


def _encode_like(msg: Msg, message: Any) -> bytes:
    """Answer in the request's encoding: JSON to a JSON request, msgpack otherwise."""
    data = msg.data or b""
    content_type = (msg.headers or {}).get("Content-Type", "")
    if content_type.startswith("application/json") or data.lstrip()[:1] == b"{":
        return encode_json(message)
    return encode(message)


def check_options(env_cls: type[Environment], options: dict[str, Any]) -> dict[str, Any]:
    """``options`` if ``env_cls(**options)`` can be called, else a ValueError naming them."""
    try:
        inspect.signature(env_cls).bind(**options)
    except TypeError as exc:
        raise ValueError(
            f"{env_cls.__qualname__} does not take the options {sorted(options)}: {exc}"
        ) from None
    return dict(options)


class ReplyTooLarge(RuntimeError):
    """A reply over the server's max_payload: the session ends with a failure (500)."""


def error_code(exc: BaseException, default: int) -> int:
    """The error code an environment's exception stands for: its ``code`` attribute when that
    is one of ``ENV_ERROR_CODES`` (the AgentBench bridge's errors carry one: 503 for a worker
    that is full or unreachable, 404 for a session it lost), else ``default``."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, bool) and code in ENV_ERROR_CODES:
        return code
    return default


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
