"""One rollout: run the agent on a job under a ``rollout`` span and build its Trajectory.

What the run came to is judged in consumers/rollout_result.py (``judge``, a pure function),
and returned as a value: ``Finished`` (a trajectory with status ok, timeout or error),
``AgentFailed`` or ``EnvironmentLost``; a drain's cancellation propagates.

The deadline (``job.deadline_s``) stands still while the agent's LLM fleet is down and holds
its calls (consumers/fleet.py): an outage within ``--fleet-outage-limit`` costs a rollout
neither its attempt nor its time.

An agent can neither stop nor hold its worker: it runs in a task of its own, where whatever it
raises (``SystemExit``, ``KeyboardInterrupt`` and ``GeneratorExit`` included) becomes its
failure; at the deadline it is cancelled and given ``CANCEL_GRACE_S``, and one that swallows
the cancellation is left running, abandoned, the rollout ending as ``timeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import traceback
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from agentarium.broker import OPENINFERENCE_SPAN_KIND, CurrentSpan, span_id_hex, trace_id_hex
from agentarium.schemas import Job, Trajectory

from .agents.envclient import EnvClient
from .agents.loading import AgentRunner, extract_reward, finite_reward
from .errors import BackendUnavailable
from .fleet import Fleet, deadline_held_by
from .rollout_context import RolloutContext, entered
from .rollout_result import (
    AgentFailed,
    Ending,
    EnvironmentLost,
    Finished,
    Happened,
    RolloutResult,
    Stage,
    Verdict,
    judge,
    message,
)
from .tracing import genai
from .tracing.llm import TracingLLM
from .tracing.proxy import secret_of

tracer = trace.get_tracer("agentarium.consumers")
log = structlog.get_logger("agentarium.consumers")

# After its deadline an agent is cancelled and given this long to end; one that ignores the
# cancellation is left running, abandoned (as a sync agent's thread is), and the rollout ends.
CANCEL_GRACE_S = 1.0
# An error text kept in a trajectory or dead letter: a traceback's head and tail up to this
# many characters (an agent may raise with a message of megabytes).
MAX_ERROR_CHARS = 16_000


@dataclass(frozen=True)
class RolloutEnv:
    """What every rollout of one worker shares."""

    runner: AgentRunner
    backend: Any
    template: Any
    proxy: Any
    model_name: str
    worker_id: str
    reward_fn: Callable[..., Any] | None = None
    # The LLM fleets behind ``backend`` (the model's, a cross-sampling model's): while one is
    # down within its outage limit, the worker pulls nothing and rollout deadlines stand still.
    fleets: tuple[Fleet, ...] = ()
    envs: EnvClient | None = None  # handed to agents that declare an ``envs`` parameter


def trajectory_for(job: Job, worker_id: str, **fields: Any) -> Trajectory:
    """The job's trajectory: its ids copied from the job, the outcome from ``fields``."""
    metadata = fields.pop("metadata", job.metadata)
    return Trajectory(
        job_id=job.job_id,
        agent=job.agent,
        task_id=job.task_id,
        group_id=job.group_id,
        sample_index=job.sample_index,
        group_size=job.group_size,
        run=job.run,
        batch_id=job.batch_id,
        is_train=job.is_train,
        worker_id=worker_id,
        task=job.task,
        metadata=metadata,
        **fields,
    )


class AgentExit(Exception):
    """The agent raised a BaseException that is not an Exception (SystemExit,
    KeyboardInterrupt, GeneratorExit, ...): the agent's failure, never the worker's end."""


async def _guarded(run: Coroutine[Any, Any, Any]) -> Any:
    # Inside the agent's task: asyncio re-raises KeyboardInterrupt and SystemExit escaping a
    # task out of the event loop, which would end the whole consumer.
    try:
        return await run
    except (Exception, asyncio.CancelledError):
        raise
    except BaseException as exc:
        raise AgentExit(
            f"the agent raised {type(exc).__name__}({message(exc)[:200]!r}): an agent may "
            "not stop its worker"
        ) from exc


async def _abandon(agent: asyncio.Future, job_id: str) -> None:
    """Cancel the agent past its deadline and give it ``CANCEL_GRACE_S`` to end; one that
    swallows its cancellation is left running."""
    agent.cancel()
    done, _ = await asyncio.wait({agent}, timeout=CANCEL_GRACE_S)
    if not done:
        log.warning(
            "the agent ignored its cancellation after the deadline: left running, abandoned",
            job_id=job_id,
            grace_s=CANCEL_GRACE_S,
        )
    agent.add_done_callback(_retrieve)


def _end_of(task: asyncio.Future) -> asyncio.Future:
    """A future that is done once ``task`` is: awaiting it waits for the task, and cancelling
    the waiter (the deadline, a drain) leaves the task running (what ``asyncio.wait({task})``
    does, without its set, its per-call waiter bookkeeping and its callback removal)."""
    waiter = task.get_loop().create_future()

    def wake(_: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_result(None)

    if task.done():
        waiter.set_result(None)
    else:
        task.add_done_callback(wake)
    return waiter


def _retrieve(task: asyncio.Future) -> None:
    """An abandoned agent's outcome, read so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _cancelled() -> bool:
    """Whether someone cancelled the running task (rather than code raising CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _traceback(exc: BaseException) -> str:
    """``exc``'s traceback, cut to ``MAX_ERROR_CHARS`` (head and tail)."""
    text = "".join(traceback.format_exception(exc))
    if len(text) <= MAX_ERROR_CHARS:
        return text
    half = MAX_ERROR_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def _record(span: trace.Span, exc: BaseException, attributes: dict[str, Any]) -> None:
    try:
        span.record_exception(exc, attributes=attributes)
    except Exception:  # OpenTelemetry asks for str(exc), which may raise
        span.record_exception(AgentExit(message(exc)), attributes=attributes)


def _span_attributes(
    job: Job, *, attempt: int, subject: str, capture: bool
) -> dict[str, AttributeValue]:
    attributes: dict[str, AttributeValue] = {
        "messaging.system": "nats",
        "messaging.operation": "process",
        "messaging.destination.name": subject,
        "messaging.message.id": job.job_id,
        "agentarium.agent": job.agent,
        "agentarium.run": job.run,
        "agentarium.group_id": job.group_id,
        "agentarium.attempt": attempt,
        OPENINFERENCE_SPAN_KIND: "AGENT",
    }
    if capture:  # the task is content like a prompt: shown only when the user opted in
        attributes[genai.OPENINFERENCE_INPUT] = json.dumps(job.task, default=str)
        attributes[genai.OPENINFERENCE_INPUT_MIME] = "application/json"
    return attributes


async def run_rollout(
    job: Job, env: RolloutEnv, *, attempt: int, parent: otel_context.Context | None, subject: str
) -> RolloutResult:
    """Run the agent once and say what it came to (``judge``, consumers/rollout_result.py).
    A drain's cancellation is not a result: it propagates, and the agent is cancelled too."""
    capture = genai.capture_message_content()
    attributes = _span_attributes(job, attempt=attempt, subject=subject, capture=capture)
    with CurrentSpan(
        tracer, "rollout", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
    ) as span:
        return await _Rollout(job, env, span, attempt=attempt, capture=capture).run()


class _Rollout:
    """One run of the agent under its span: the facts ``judge`` reads (the LLM client's and
    the environment sessions' errors, the deadline), and the trajectory its verdict names."""

    def __init__(
        self, job: Job, env: RolloutEnv, span: trace.Span, *, attempt: int, capture: bool
    ) -> None:
        self.job, self.env, self.span = job, env, span
        self.attempt, self.capture = attempt, capture
        self.started = time.time()
        self.trace_id = trace_id_hex(span)
        self.span_id = span_id_hex(span)  # the trajectory keeps it: the trainer's step links to it
        self.llm = TracingLLM(
            env.backend,
            env.template,
            job_sampling=job.sampling,
            route_key=job.group_id,
            rid_prefix=job.job_id,
            model_name=env.model_name,
            parent_context=otel_context.get_current(),
            capture_content=capture,
        )
        self.envs = (
            env.envs.bind(job_id=job.job_id, deadline_s=job.deadline_s)
            if env.envs is not None and env.runner.spec.envs
            else None
        )
        self.deadline = asyncio.timeout(job.deadline_s)
        self.agent: asyncio.Future | None = None  # the agent's own task, once started
        # what the agent's code reads of its rollout (consumers/rollout_context.py); its notes
        # join the trajectory's metadata
        self.context = RolloutContext(job_id=job.job_id, attempt=attempt, deadline_s=job.deadline_s)
        self.secret = ""  # the endpoint's: scrubbed from whatever the agent's failure says

    async def run(self) -> RolloutResult:
        try:
            result = await self._agent()
        except (Exception, asyncio.CancelledError) as exc:
            verdict = judge(self._happened(Stage.AGENT, exc))
            if verdict.ending is Ending.RELEASED:
                self._release()
                raise
            return await self._result(verdict, exc)
        verdict = judge(self._happened(Stage.AGENT))
        if verdict.ending is not Ending.OK:
            return await self._result(verdict)
        try:
            reward, metrics = await self._reward(result)
        except BaseException as exc:  # RewardError, or a failing reward function (even exit())
            verdict = judge(self._happened(Stage.REWARD, exc))
            if verdict.ending is Ending.RELEASED:
                raise
            return await self._result(verdict, exc)
        self.span.set_attribute("agentarium.reward", reward)
        return Finished(trajectory=self.trajectory("ok", reward=reward, metrics=metrics))

    async def _agent(self) -> Any:
        """The agent's result; whatever it raises (``AgentExit`` for a BaseException) or the
        deadline's TimeoutError is the caller's to judge."""
        env, job = self.env, self.job
        # Only an endpoint-style agent calls the proxy: the others get no route to open.
        registration = (
            env.proxy.register(job.job_id, self.llm)
            if env.runner.spec.style == "endpoint"
            else contextlib.nullcontext("")
        )
        with registration as endpoint:
            self.secret = secret_of(endpoint)
            # The agent's own task: the deadline cancels this one, which stops waiting
            # whether or not the agent lets itself be cancelled.
            with entered(self.context):  # the agent's task copies the context as it starts
                self.agent = asyncio.ensure_future(
                    _guarded(
                        env.runner.run(job.task, llm=self.llm, endpoint=endpoint, envs=self.envs)
                    )
                )
            async with self.deadline:
                with deadline_held_by(env.fleets, self.deadline):
                    await _end_of(self.agent)
            return self.agent.result()

    async def _reward(self, result: Any) -> tuple[float, dict]:
        reward, metrics = extract_reward(result)
        if self.env.reward_fn is not None:
            provisional = self.trajectory("ok", provisional=True, reward=0.0, metrics=metrics)
            reward_result = self.env.reward_fn(self.job.task, result, provisional)
            if asyncio.iscoroutine(reward_result):
                reward_result = await reward_result
            reward, extra = extract_reward(reward_result)
            metrics = {**metrics, **extra}
        return finite_reward(reward), metrics

    def _happened(self, stage: Stage, exc: BaseException | None = None) -> Happened:
        backend = [e for e in self.llm.errors if isinstance(e, BackendUnavailable)]
        env_errors = self.envs.errors if self.envs is not None else []
        return Happened(
            stage=stage,
            exc=exc,
            deadline_expired=self.deadline.expired(),
            deadline_s=self.job.deadline_s,
            cancelled=_cancelled(),
            backend_error=backend[-1] if backend else None,
            env_error=env_errors[-1] if env_errors else None,
        )

    async def _result(self, verdict: Verdict, exc: BaseException | None = None) -> RolloutResult:
        """The result the verdict names; ``exc``: what the stage raised."""
        match verdict.ending:
            case Ending.TIMEOUT:
                assert self.agent is not None, "the deadline runs only once the agent does"
                await _abandon(self.agent, self.job.job_id)
                return Finished(trajectory=self.trajectory("timeout", error=verdict.error))
            case Ending.BACKEND_FAILED:
                return Finished(trajectory=self.trajectory("error", error=verdict.error))
            case Ending.ENVIRONMENT_LOST:
                if exc is not None:
                    _record(self.span, exc, {})
                return EnvironmentLost(trajectory=self.trajectory("error", error=verdict.error))
            case Ending.AGENT_FAILED:
                assert exc is not None, "an agent fails by raising"
                return self._agent_failed(exc)
        raise AssertionError(f"no result for {verdict}")  # OK and RELEASED are the caller's

    def _agent_failed(self, exc: BaseException) -> AgentFailed:
        """The agent's failure, its text and span event without the endpoint's secret."""
        text, said = _traceback(exc), message(exc)
        if self.secret:
            text, said = text.replace(self.secret, "***"), said.replace(self.secret, "***")
        _record(self.span, exc, {"exception.message": said, "exception.stacktrace": text})
        return AgentFailed(
            error=text, calls=list(self.llm.calls), trace_id=self.trace_id, span_id=self.span_id
        )

    def _release(self) -> None:
        """A drain: the worker releases the job, and the agent goes too."""
        if self.agent is not None:
            self.agent.cancel()
            self.agent.add_done_callback(_retrieve)

    def trajectory(self, status: str, *, provisional: bool = False, **extra: Any) -> Trajectory:
        """The job's trajectory with ``status``, the calls so far, and the span marked so."""
        span, job, envs = self.span, self.job, self.envs
        span.set_attribute("agentarium.status", status)
        if status != "ok":
            span.set_status(Status(StatusCode.ERROR, extra.get("error", status)[:200]))
        if self.capture and not provisional:
            outcome = {"status": status, "reward": extra.get("reward")}
            span.set_attribute(genai.OPENINFERENCE_OUTPUT, json.dumps(outcome))
            span.set_attribute(genai.OPENINFERENCE_OUTPUT_MIME, "application/json")
        notes = dict(self.context.notes)
        if envs is not None and envs.summary():
            # what each environment session did; its tool results reached the model only
            # as prompt context, so the trainer's loss mask leaves them out anyway
            notes["envs"] = envs.summary()
        if notes:
            extra["metadata"] = {**job.metadata, **notes}
        return trajectory_for(
            job,
            self.env.worker_id,
            status=status,
            calls=list(self.llm.calls),
            attempts=self.attempt,
            started_at=self.started,
            finished_at=time.time(),
            trace_id=self.trace_id,
            span_id=self.span_id,
            **extra,
        )
