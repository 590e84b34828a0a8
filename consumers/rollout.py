"""One rollout: run the agent on a job under a ``rollout`` span and build its Trajectory.

Outcomes are classified here, once:
  ok        the agent returned and a finite reward was found
  timeout   the job's deadline passed (calls made so far are kept)
  error     infrastructure failed (the LLM backend was unreachable after retries):
            recorded, never scored as reward 0
  agent error (AgentFailure)  the agent or reward function raised: the worker retries it
  environment failure (EnvFailure)  an environment service was unavailable (no worker with
            room, or the session's worker died), even if the agent swallowed the error: the
            worker retries it; its last attempt is stored as status ``error``, never reward 0

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
from dataclasses import dataclass, field
from typing import Any

import structlog
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from broker import OPENINFERENCE_SPAN_KIND, CurrentSpan, span_id_hex, trace_id_hex
from schemas import Job, Trajectory

from . import genai
from .agents import AgentRunner, extract_reward, finite_reward
from .envclient import EnvClient
from .errors import BackendUnavailable, EnvironmentUnavailable
from .fleet import Fleet, deadline_held_by
from .llm import TracingLLM
from .proxy import secret_of

tracer = trace.get_tracer("agentarium.consumers")
log = structlog.get_logger("agentarium.consumers")

# After its deadline an agent is cancelled and given this long to end; one that ignores the
# cancellation is left running, abandoned (as a sync agent's thread is), and the rollout ends.
CANCEL_GRACE_S = 1.0
# An error text kept in a trajectory or dead letter: a traceback's head and tail up to this
# many characters (an agent may raise with a message of megabytes).
MAX_ERROR_CHARS = 16_000


@dataclass
class AgentFailure(Exception):
    """The agent (or its reward function) raised; retried by the worker's policy."""

    error: str
    calls: list = field(default_factory=list)
    trace_id: str = ""
    span_id: str = ""


@dataclass
class EnvFailure(Exception):
    """An environment service failed under the rollout: infrastructure, retried by the worker;
    ``trajectory`` (status ``error``) is what its last attempt stores."""

    trajectory: Trajectory


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
            f"the agent raised {type(exc).__name__}({_message(exc)[:200]!r}): an agent may "
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


def _message(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception:  # an exception whose str() raises
        return f"<{type(exc).__name__}: its message cannot be printed>"


def _traceback() -> str:
    """The exception being handled, as a traceback cut to ``MAX_ERROR_CHARS`` (head and tail)."""
    text = traceback.format_exc()
    if len(text) <= MAX_ERROR_CHARS:
        return text
    half = MAX_ERROR_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


def _record(span: trace.Span, exc: BaseException, attributes: dict[str, Any]) -> None:
    try:
        span.record_exception(exc, attributes=attributes)
    except Exception:  # OpenTelemetry asks for str(exc), which may raise
        span.record_exception(AgentExit(_message(exc)), attributes=attributes)


async def run_rollout(
    job: Job, env: RolloutEnv, *, attempt: int, parent: otel_context.Context | None, subject: str
) -> Trajectory:
    """Run the agent once. Returns a Trajectory (ok/timeout/error) or raises AgentFailure."""
    started = time.time()
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
    capture = genai.capture_message_content()
    if capture:  # the task is content like a prompt: shown only when the user opted in
        attributes[genai.OPENINFERENCE_INPUT] = json.dumps(job.task, default=str)
        attributes[genai.OPENINFERENCE_INPUT_MIME] = "application/json"
    with CurrentSpan(
        tracer, "rollout", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
    ) as span:
        trace_id = trace_id_hex(span)
        # The trajectory keeps this span's id: the trainer's step links to it.
        span_id = span_id_hex(span)
        llm = TracingLLM(
            env.backend,
            env.template,
            job_sampling=job.sampling,
            route_key=job.group_id,
            rid_prefix=job.job_id,
            model_name=env.model_name,
            parent_context=otel_context.get_current(),
            capture_content=capture,
        )

        envs = (
            env.envs.bind(job_id=job.job_id, deadline_s=job.deadline_s)
            if env.envs is not None and env.runner.spec.envs
            else None
        )

        # Backend failures the agent may have swallowed (the OpenAI SDK turns the proxy's 503
        # into its own exception): they make the rollout an infrastructure error.
        def infra_failure() -> BackendUnavailable | None:
            found = [e for e in llm.errors if isinstance(e, BackendUnavailable)]
            return found[-1] if found else None

        def env_failure() -> EnvFailure | None:
            """An environment that was unavailable, raised or swallowed: retried."""
            if envs is None or not envs.errors:
                return None
            return EnvFailure(done("error", error=f"environment unavailable: {envs.errors[-1]}"))

        def done(status: str, *, provisional: bool = False, **extra: Any) -> Trajectory:
            span.set_attribute("agentarium.status", status)
            if status != "ok":
                span.set_status(Status(StatusCode.ERROR, extra.get("error", status)[:200]))
            if capture and not provisional:
                outcome = {"status": status, "reward": extra.get("reward")}
                span.set_attribute(genai.OPENINFERENCE_OUTPUT, json.dumps(outcome))
                span.set_attribute(genai.OPENINFERENCE_OUTPUT_MIME, "application/json")
            if envs is not None and envs.summary():
                # what each environment session did; its tool results reached the model only
                # as prompt context, so the trainer's loss mask leaves them out anyway
                extra["metadata"] = {**job.metadata, "envs": envs.summary()}
            return trajectory_for(
                job,
                env.worker_id,
                status=status,
                calls=list(llm.calls),
                attempts=attempt,
                started_at=started,
                finished_at=time.time(),
                trace_id=trace_id,
                span_id=span_id,
                **extra,
            )

        deadline = asyncio.timeout(job.deadline_s)
        secret = ""  # the endpoint's: scrubbed from whatever the agent's failure says

        def failure(exc: BaseException) -> AgentFailure:
            """The agent's failure, its text and span event without the endpoint's secret. The
            caller raises it ``from None``: a chained cause would carry the raw text along."""
            text, message = _traceback(), _message(exc)
            if secret:
                text, message = text.replace(secret, "***"), message.replace(secret, "***")
            _record(span, exc, {"exception.message": message, "exception.stacktrace": text})
            return AgentFailure(text, calls=list(llm.calls), trace_id=trace_id, span_id=span_id)

        agent: asyncio.Future | None = None
        try:
            # Only an endpoint-style agent calls the proxy: the others get no route to open.
            registration = (
                env.proxy.register(job.job_id, llm)
                if env.runner.spec.style == "endpoint"
                else contextlib.nullcontext("")
            )
            with registration as endpoint:
                secret = secret_of(endpoint)
                # The agent's own task: the deadline cancels this one, which stops waiting
                # whether or not the agent lets itself be cancelled.
                agent = asyncio.ensure_future(
                    _guarded(env.runner.run(job.task, llm=llm, endpoint=endpoint, envs=envs))
                )
                async with deadline:
                    with deadline_held_by(env.fleets, deadline):
                        await _end_of(agent)
                result = agent.result()
        except TimeoutError as exc:
            if deadline.expired():
                assert agent is not None, "the deadline runs only once the agent does"
                await _abandon(agent, job.job_id)
                return done(
                    "timeout", error=f"rollout exceeded its deadline of {job.deadline_s:g}s"
                )
            if infra_failure() is not None:
                return done("error", error=f"LLM backend failed: {infra_failure()}")
            if (env_lost := env_failure()) is not None:
                raise env_lost from None
            raise failure(exc) from None
        except BackendUnavailable as exc:
            return done("error", error=f"LLM backend failed: {exc}")
        except asyncio.CancelledError as exc:
            if _cancelled():  # a drain: the worker releases the job, the agent goes too
                if agent is not None:
                    agent.cancel()
                    agent.add_done_callback(_retrieve)
                raise
            # The agent raised CancelledError itself (nobody cancelled the rollout): its bug.
            raise failure(exc) from None
        except Exception as exc:  # AgentExit included: no agent may stop its worker
            if infra_failure() is not None:
                return done("error", error=f"LLM backend failed: {infra_failure()}")
            if isinstance(exc, EnvironmentUnavailable) or env_failure() is not None:
                _record(span, exc, {})
                env_lost = env_failure() or EnvFailure(
                    done("error", error=f"environment unavailable: {exc}")
                )
                raise env_lost from None
            raise failure(exc) from None

        if (env_lost := env_failure()) is not None:
            raise env_lost  # the agent swallowed it: its reward may be a failed session's 0
        try:
            reward, metrics = extract_reward(result)
            if env.reward_fn is not None:
                provisional = done("ok", provisional=True, reward=0.0, metrics=metrics)
                reward_result = env.reward_fn(job.task, result, provisional)
                if asyncio.iscoroutine(reward_result):
                    reward_result = await reward_result
                reward, extra = extract_reward(reward_result)
                metrics = {**metrics, **extra}
            reward = finite_reward(reward)
        except BaseException as exc:  # RewardError, or a failing reward function (even exit())
            if isinstance(exc, asyncio.CancelledError) and _cancelled():
                raise
            raise failure(exc) from None
        span.set_attribute("agentarium.reward", reward)
        return done("ok", reward=reward, metrics=metrics)
