"""The environment client: sessions with environment services (``agentarium env serve``).

    envs = EnvClient(nc, topology)
    async with envs.session("sql", {"index": "select-01"}) as env:
        env.observation.messages, env.observation.tools      # what the agent sees first
        result = await env.step(assistant_message)          # a StepResult: tool results, done
    env.outcome                                              # the score, closed on exit

A rollout function that declares an ``envs`` parameter gets one bound to its job: its
sessions' deadline defaults to the rollout's, and what they did (env, steps, score) lands in the
trajectory's ``metadata["envs"]``.

Failures, by what the rollout should do (consumers/errors.py): a start backs off while no worker
has room (no responders, 503) until its deadline, then ``EnvironmentUnavailable``; a step's
request is sent again with the same ``seq`` every ``RESEND_S`` until it is answered or times out
(the worker never runs a step twice; a resend finds a worker that died meanwhile at once),
and a worker that is gone (no responders, 404, ``max_timeouts`` timeouts in a row) raises
``EnvironmentUnavailable`` at once: the rollout is an infrastructure error, retried, never
scored 0. Each start, step and close is a span (``env.start``, ``env.step``, ``env.close``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import nats.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from agentarium.broker import OPENINFERENCE_SPAN_KIND, Backoff, Topology, inject_headers
from agentarium.schemas import (
    MSGPACK,
    EnvCall,
    EnvError,
    EnvStart,
    EnvStarted,
    Observation,
    SchemaError,
    SessionOutcome,
    StepResult,
    decode,
)

from ..errors import (
    EnvClientError,
    EnvironmentFailed,
    EnvironmentTimeout,
    EnvironmentUnavailable,
    EnvRequestError,
)

tracer = trace.get_tracer("agentarium.consumers")

DEFAULT_DEADLINE_S = 600.0
# A session bound to a rollout lives this much past the rollout's deadline, so the rollout's
# own timeout ends it (status timeout) rather than the worker's.
DEADLINE_SLACK_S = 5.0
START_MARGIN_S = 1.0
# A step or close is sent again this often while unanswered (the same seq): a worker that died
# with the request in flight is found by the resend's no responders, not after the whole timeout.
RESEND_S = 5.0


class _NoResponders(Exception):
    pass


class _Broken(Exception):
    """This side's NATS connection failed (closed, draining): nothing to wait for."""


class _Refused(Exception):
    def __init__(self, error: EnvError) -> None:
        super().__init__(error.message)
        self.error = error


class EnvClient:
    """Opens sessions with environment services over ``nc``; cheap to make and to ``bind``."""

    def __init__(
        self,
        nc: Client,
        topology: Topology | str = "agentarium",
        *,
        start_timeout_s: float = 60.0,
        step_timeout_s: float = 60.0,
        max_timeouts: int = 3,
        backoff_s: float = 0.05,
        max_backoff_s: float = 0.5,
        job_id: str = "",
        deadline_at: float | None = None,
    ) -> None:
        self.nc = nc
        self.topology = topology if isinstance(topology, Topology) else Topology(topology)
        self.start_timeout_s = start_timeout_s
        self.step_timeout_s = step_timeout_s
        self.max_timeouts = max(1, max_timeouts)
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.job_id = job_id
        self.deadline_at = deadline_at  # time.monotonic() of the rollout's deadline, if bound
        self.sessions: list[EnvSession] = []
        self.errors: list[EnvironmentUnavailable] = []  # kept even if the agent swallowed them

    def bind(self, *, job_id: str, deadline_s: float | None = None) -> EnvClient:
        """A client for one rollout: its own sessions and errors, the rollout's deadline."""
        return EnvClient(
            self.nc,
            self.topology,
            start_timeout_s=self.start_timeout_s,
            step_timeout_s=self.step_timeout_s,
            max_timeouts=self.max_timeouts,
            backoff_s=self.backoff_s,
            max_backoff_s=self.max_backoff_s,
            job_id=job_id,
            deadline_at=None if deadline_s is None else time.monotonic() + deadline_s,
        )

    def session(
        self,
        name: str,
        task: dict,
        *,
        deadline_s: float | None = None,
        metadata: dict | None = None,
    ) -> EnvSession:
        """A session of environment ``name`` on ``task``, started by ``async with`` (or
        ``await session.start()``) and closed on exit. ``deadline_s``: the session's limit,
        by default the bound rollout's (plus a few seconds), else 600 s."""
        start_wait_s = deadline_s
        if self.deadline_at is not None:
            remaining = self.deadline_at - time.monotonic()
            # Give up waiting for a worker with room a little before the rollout's deadline,
            # so a rollout that found none is retried (EnvironmentUnavailable), not timed out.
            start_wait_s = max(0.1, remaining - min(START_MARGIN_S, 0.1 * remaining))
            if deadline_s is None:
                deadline_s = max(1.0, remaining + DEADLINE_SLACK_S)
        if deadline_s is None:
            deadline_s = DEFAULT_DEADLINE_S
        session = EnvSession(
            self,
            name,
            task,
            deadline_s=deadline_s,
            start_wait_s=min(deadline_s, start_wait_s or deadline_s),
            metadata=metadata or {},
        )
        self.sessions.append(session)
        return session

    async def start(self, name: str, task: dict, **kwargs: Any) -> EnvSession:
        """``session(...)`` started; close it yourself (``await session.close()``)."""
        return await self.session(name, task, **kwargs).start()

    def summary(self) -> list[dict[str, Any]]:
        """What each session of this client did, for the trajectory's metadata."""
        return [s.summary() for s in self.sessions if s.session_started]

    # ---- one request -------------------------------------------------------------------------
    async def _request(self, subject: str, payload: bytes, timeout: float) -> Msg:
        """One request; raises _NoResponders, nats' TimeoutError, _Broken or _Refused (an
        EnvError)."""
        try:
            msg = await self.nc.request(
                subject, payload, timeout=timeout, headers=inject_headers(MSGPACK.headers())
            )
        except nats.errors.NoRespondersError:
            raise _NoResponders() from None
        except nats.errors.TimeoutError:
            raise
        except nats.errors.Error as exc:
            raise _Broken(f"{type(exc).__name__}: {exc}") from exc
        headers = msg.headers or {}
        if "Nats-Service-Error-Code" in headers:
            try:
                error = decode(EnvError, msg.data, headers.get("Content-Type"))
            except SchemaError:
                code = int(headers.get("Nats-Service-Error-Code") or 500)
                error = EnvError(
                    code=code, error="error", message=headers.get("Nats-Service-Error", "")
                )
            raise _Refused(error)
        return msg

    def _lost(self, error: EnvironmentUnavailable) -> EnvironmentUnavailable:
        self.errors.append(error)
        return error


class EnvSession:
    """One session: ``observation`` after start, ``step()`` until ``done``, ``close()``."""

    def __init__(
        self,
        client: EnvClient,
        name: str,
        task: dict,
        *,
        deadline_s: float,
        start_wait_s: float,
        metadata: dict,
    ) -> None:
        self.client = client
        self.name = name
        self.task = task
        self.deadline_s = deadline_s
        self.start_wait_s = start_wait_s  # how long a start waits for a worker with room
        self.metadata = metadata
        self.session_id = uuid.uuid4().hex
        self.worker = ""
        self.subject = ""
        self.observation: Observation | None = None
        self.outcome: SessionOutcome | None = None
        self.seq = 0
        self.done = False
        self.rewards: list[float] = []
        self.truncated = 0  # steps whose observation the worker cut
        self.error: EnvClientError | None = None

    def __repr__(self) -> str:
        return (
            f"<EnvSession {self.name} {self.session_id} worker={self.worker or '-'} "
            f"steps={self.seq} done={self.done}>"
        )

    @property
    def session_started(self) -> bool:
        return self.observation is not None

    @property
    def ended(self) -> bool:
        """Closed, or lost: the worker is gone, the environment raised, the deadline passed."""
        return self.outcome is not None or self.error is not None

    async def __aenter__(self) -> EnvSession:
        return await self.start()

    async def __aexit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if not self.session_started or self.ended:
            return
        if exc is None:
            await self.close()
            return
        try:  # leaving on an error: close what is still there, never hide the error
            await self.close()
        except EnvClientError:
            pass

    def _fail(self, error: EnvClientError) -> EnvClientError:
        if not isinstance(error, EnvRequestError):  # a refused request leaves the session open
            self.error = error
        if isinstance(error, EnvironmentUnavailable):
            self.client._lost(error)
        return error

    def _broken(self, exc: _Broken) -> EnvironmentUnavailable:
        return EnvironmentUnavailable(
            f"env {self.name} session {self.session_id}: the NATS connection failed ({exc})",
            env=self.name,
            session=self.session_id,
        )

    def _refused(self, refused: _Refused, what: str) -> EnvClientError:
        e = refused.error
        text = f"env {self.name} session {self.session_id}: {what} refused ({e.code} {e.error}): {e.message}"
        kinds: dict[int, type[EnvClientError]] = {
            404: EnvironmentUnavailable,
            408: EnvironmentTimeout,
            500: EnvironmentFailed,
            503: EnvironmentUnavailable,
        }
        cls = kinds.get(e.code, EnvRequestError)
        return self._fail(cls(text, env=self.name, session=self.session_id, code=e.code))

    # ---- start ---------------------------------------------------------------------------
    async def start(self) -> EnvSession:
        if self.session_started:
            return self
        client = self.client
        request = EnvStart(
            session_id=self.session_id,
            task=self.task,
            job_id=client.job_id,
            deadline_s=self.deadline_s,
            metadata=self.metadata,
        )
        payload = MSGPACK.encode(request)
        subject = client.topology.env_start_subject(self.name)
        with self._span("env.start", "CHAIN") as span:
            deadline = time.monotonic() + self.start_wait_s
            backoff = Backoff(
                initial_s=min(client.backoff_s, client.max_backoff_s), max_s=client.max_backoff_s
            )
            timeouts, waits, last = 0, 0, ""
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    error = EnvironmentUnavailable(
                        f"env {self.name}: no worker took the session within "
                        f"{self.start_wait_s:.3g}s ({last}): start `agentarium env serve "
                        f"{self.name}` or raise its --capacity",
                        env=self.name,
                        session=self.session_id,
                    )
                    raise _record(span, self._fail(error))
                try:
                    reply = await client._request(
                        subject, payload, min(client.start_timeout_s, remaining)
                    )
                    break
                except _NoResponders:
                    last = "no worker with room: no responders"
                except _Broken as exc:
                    raise _record(span, self._fail(self._broken(exc))) from exc
                except nats.errors.TimeoutError:
                    timeouts += 1
                    last = f"{timeouts} start request(s) timed out"
                    if timeouts >= client.max_timeouts:
                        error = EnvironmentUnavailable(
                            f"env {self.name}: {last} after {client.start_timeout_s:g}s each",
                            env=self.name,
                            session=self.session_id,
                        )
                        raise _record(span, self._fail(error)) from None
                    continue  # the same session id: a worker that got it answers the same
                except _Refused as refused:
                    if refused.error.code != 503:
                        raise _record(span, self._refused(refused, "start")) from None
                    last = f"503: {refused.error.message}"
                waits += 1
                await asyncio.sleep(
                    min(backoff.delay(waits), max(0.0, deadline - time.monotonic()))
                )
            started = decode(EnvStarted, reply.data, (reply.headers or {}).get("Content-Type"))
            self.worker, self.subject = started.worker, started.subject
            self.observation = started.observation
            span.set_attribute("agentarium.env.worker", self.worker)
            span.set_attribute("agentarium.env.backoffs", waits)
        return self

    # ---- step ----------------------------------------------------------------------------
    async def step(self, message: dict) -> StepResult:
        """Send the assistant ``message`` (its ``tool_calls``); returns the tool results."""
        if not self.session_started:
            raise EnvRequestError("step before start", env=self.name, session=self.session_id)
        if self.ended:
            raise EnvRequestError(
                f"env {self.name} session {self.session_id} has ended", env=self.name
            )
        seq = self.seq + 1
        payload = MSGPACK.encode(EnvCall(op="step", seq=seq, message=message))
        tools = [
            str((call.get("function") or {}).get("name", ""))
            for call in message.get("tool_calls") or []
            if isinstance(call, dict)
        ]
        with self._span("env.step", "TOOL", seq=seq, tools=tools) as span:
            reply = await self._call(payload, "step", span)
            result = decode(StepResult, reply.data, (reply.headers or {}).get("Content-Type"))
            self.seq = seq
            self.done = self.done or result.done
            if result.reward is not None:
                self.rewards.append(result.reward)
                span.set_attribute("agentarium.env.reward", result.reward)
            self.truncated += int(result.truncated)
            span.set_attribute("agentarium.env.done", result.done)
            span.set_attribute("agentarium.env.truncated", result.truncated)
        return result

    # ---- close ---------------------------------------------------------------------------
    async def close(self) -> SessionOutcome:
        """End the session and get its score; a second call returns the same outcome."""
        if self.outcome is not None:
            return self.outcome
        if self.error is not None:
            raise self.error
        if not self.session_started:
            raise EnvRequestError("close before start", env=self.name, session=self.session_id)
        with self._span("env.close", "CHAIN", seq=self.seq) as span:
            reply = await self._call(MSGPACK.encode(EnvCall(op="close")), "close", span)
            outcome = decode(SessionOutcome, reply.data, (reply.headers or {}).get("Content-Type"))
            self.outcome = outcome
            span.set_attribute("agentarium.env.score", outcome.score)
            span.set_attribute("agentarium.env.steps", outcome.steps)
        return outcome

    async def _call(self, payload: bytes, what: str, span: Any) -> Msg:
        """One step or close, sent again (the same bytes, so the same seq) when it times out."""
        client = self.client
        for attempt in range(1, client.max_timeouts + 1):
            try:
                return await self._send(payload, client.step_timeout_s)
            except _NoResponders:
                error = EnvironmentUnavailable(
                    f"env {self.name} session {self.session_id}: worker {self.worker} is gone "
                    f"(no responders on {self.subject})",
                    env=self.name,
                    session=self.session_id,
                )
                raise _record(span, self._fail(error)) from None
            except nats.errors.TimeoutError:
                span.set_attribute("agentarium.env.timeouts", attempt)
            except _Broken as exc:
                raise _record(span, self._fail(self._broken(exc))) from exc
            except _Refused as refused:
                raise _record(span, self._refused(refused, what)) from None
        error = EnvironmentUnavailable(
            f"env {self.name} session {self.session_id}: worker {self.worker} did not answer "
            f"the {what} ({client.max_timeouts} tries of {client.step_timeout_s:g}s)",
            env=self.name,
            session=self.session_id,
        )
        raise _record(span, self._fail(error))

    async def _send(self, payload: bytes, timeout: float) -> Msg:
        """One try of ``timeout`` seconds, the request sent again every ``RESEND_S``: a request
        the server delivered to a worker that had just died (before the server saw its
        connection close) is lost, and only a new request learns, by no responders, that the
        worker is gone. The worker answers a resend of the step it is running once that step
        ends, from its stored reply (the same seq: never run twice)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            try:
                return await self.client._request(
                    self.subject, payload, max(min(deadline - loop.time(), RESEND_S), 0.001)
                )
            except nats.errors.TimeoutError:
                if loop.time() >= deadline:
                    raise

    # ---- records -------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        return {
            "env": self.name,
            "session": self.session_id,
            "worker": self.worker,
            "steps": self.seq,
            "done": self.done,
            "score": None if self.outcome is None else self.outcome.score,
            "rewards": list(self.rewards),
            "truncated_steps": self.truncated,
            "error": None if self.error is None else type(self.error).__name__,
        }

    def _span(self, name: str, kind: str, **extra: Any) -> Any:
        attributes: dict[str, Any] = {
            OPENINFERENCE_SPAN_KIND: kind,
            "agentarium.env.name": self.name,
            "agentarium.env.session": self.session_id,
        }
        if self.worker:
            attributes["agentarium.env.worker"] = self.worker
        if self.client.job_id:
            attributes["agentarium.job_id"] = self.client.job_id
        if "seq" in extra:
            attributes["agentarium.env.seq"] = extra["seq"]
        if extra.get("tools"):
            attributes["agentarium.env.tools"] = list(extra["tools"])
        return tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes)


def _record(span: Any, error: EnvClientError) -> EnvClientError:
    span.set_attribute("error.type", type(error).__name__)
    span.set_status(Status(StatusCode.ERROR, str(error)[:200]))
    return error
