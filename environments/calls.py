"""A session's requests after its start: steps, and the close that scores it.

``handle`` runs in its own task per request, one at a time per session (the session's lock).
Steps carry ``seq``: the last seq again gets the stored reply (the step is never run twice),
any other than the next is refused (409). A step is cut by the session's deadline (408); an
environment that raises, returns the wrong type or answers too big ends its session (500, or
the code its exception carries). A request for a session no longer here is answered from its
tombstone (a retried close gets the same answer) or 404.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

import structlog

from agentarium.schemas import EnvCall, SchemaError, SessionOutcome, StepResult, decode

from .caps import cap_step_result
from .config import EnvWorkerConfig
from .metrics import EnvMetrics
from .request import ReplyTooLarge, Request, describe, error_code
from .sessions import Session, SessionTable
from .stats import WorkerCounters

log = structlog.get_logger("agentarium.environments")


class SessionCalls:
    """The request handling of one worker's open sessions; ``env_name`` names its
    environment class in the errors of a wrong return type."""

    def __init__(
        self,
        config: EnvWorkerConfig,
        env_name: str,
        sessions: SessionTable,
        counters: WorkerCounters,
        metrics: EnvMetrics,
    ) -> None:
        self.config = config
        self.env_name = env_name
        self.sessions = sessions
        self.counters = counters
        self.metrics = metrics

    async def handle(self, req: Request) -> None:
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
                    f"{self.env_name}.step returned {type(result).__name__}, not a StepResult"
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
            if not isinstance(outcome, SessionOutcome):
                raise TypeError(
                    f"{self.env_name}.close returned {type(outcome).__name__}, not a SessionOutcome"
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
