"""One rollout: run the agent on a job under a ``rollout`` span and build its Trajectory.

Outcomes are classified here, once:
  ok        the agent returned and a finite reward was found
  timeout   the job's deadline passed (calls made so far are kept)
  error     infrastructure failed (the LLM backend was unreachable after retries):
            recorded, never scored as reward 0
  agent error (AgentFailure)  the agent or reward function raised: the worker retries it
"""

from __future__ import annotations

import asyncio
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

from broker import OPENINFERENCE_SPAN_KIND, span_id_hex, trace_id_hex
from schemas import Job, Trajectory

from . import genai
from .agents import AgentRunner, extract_reward, finite_reward
from .errors import BackendUnavailable
from .llm import TracingLLM

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


def trajectory_for(job: Job, worker_id: str, **fields: Any) -> Trajectory:
    """The job's trajectory: its ids copied from the job, the outcome from ``fields``."""
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
        metadata=job.metadata,
        **fields,
    )


class _DeadlinePassed(Exception):
    """The job's deadline passed before the agent returned."""


async def _within(run: Coroutine[Any, Any, Any], seconds: float, job_id: str) -> Any:
    """``await run`` for at most ``seconds``, in a task of its own, so that an agent which
    swallows its cancellation cannot hold the rollout (and its worker slot) past the deadline."""
    agent = asyncio.ensure_future(_guarded(run))
    try:
        done, _ = await asyncio.wait({agent}, timeout=seconds)
    except asyncio.CancelledError:  # a drain cancels the rollout: the agent goes too
        agent.cancel()
        agent.add_done_callback(_retrieve)
        raise
    if done:
        return agent.result()
    agent.cancel()
    done, _ = await asyncio.wait({agent}, timeout=CANCEL_GRACE_S)
    if done:
        _retrieve(agent)
    else:
        log.warning(
            "the agent ignored its cancellation after the deadline: left running, abandoned",
            job_id=job_id,
            grace_s=CANCEL_GRACE_S,
        )
        agent.add_done_callback(_retrieve)
    raise _DeadlinePassed


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
            f"the agent raised {type(exc).__name__}({_shown(exc)}): an agent may not stop its worker"
        ) from exc


def _shown(exc: BaseException) -> str:
    try:
        text = str(exc)
    except Exception:
        return "<unprintable>"
    return repr(text[:200]) if text else ""


def _record(span: trace.Span, exc: BaseException) -> None:
    try:
        span.record_exception(exc)
    except Exception:  # an exception whose str() raises: OpenTelemetry asks for it
        span.record_exception(AgentExit(f"{type(exc).__name__} (its message cannot be printed)"))


def _retrieve(task: asyncio.Future) -> None:
    """An abandoned agent's outcome, read so that asyncio does not log it as never retrieved."""
    if not task.cancelled():
        task.exception()


def _cancelled() -> bool:
    """Whether someone cancelled the running task (rather than code raising CancelledError)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


def _traceback() -> str:
    """The exception being handled, as a traceback cut to ``MAX_ERROR_CHARS`` (head and tail)."""
    text = traceback.format_exc()
    if len(text) <= MAX_ERROR_CHARS:
        return text
    half = MAX_ERROR_CHARS // 2
    return f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"


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
    with tracer.start_as_current_span(
        "rollout", context=parent, kind=SpanKind.CONSUMER, attributes=attributes
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

        # Backend failures the agent may have swallowed (the OpenAI SDK turns the proxy's 503
        # into its own exception): they make the rollout an infrastructure error.
        def infra_failure() -> BackendUnavailable | None:
            found = [e for e in llm.errors if isinstance(e, BackendUnavailable)]
            return found[-1] if found else None

        def done(status: str, *, provisional: bool = False, **extra: Any) -> Trajectory:
            span.set_attribute("agentarium.status", status)
            if status != "ok":
                span.set_status(Status(StatusCode.ERROR, extra.get("error", status)[:200]))
            if capture and not provisional:
                outcome = {"status": status, "reward": extra.get("reward")}
                span.set_attribute(genai.OPENINFERENCE_OUTPUT, json.dumps(outcome))
                span.set_attribute(genai.OPENINFERENCE_OUTPUT_MIME, "application/json")
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

        try:
            with env.proxy.register(job.job_id, llm):
                result = await _within(
                    env.runner.run(job.task, llm=llm, endpoint=env.proxy.endpoint_for(job.job_id)),
                    job.deadline_s,
                    job.job_id,
                )
        except _DeadlinePassed:
            return done("timeout", error=f"rollout exceeded its deadline of {job.deadline_s:g}s")
        except BackendUnavailable as exc:
            return done("error", error=f"LLM backend failed: {exc}")
        except asyncio.CancelledError:
            if _cancelled():  # a drain: the worker releases the job
                raise
            # The agent raised CancelledError itself (nobody cancelled the rollout): its bug.
            raise AgentFailure(
                _traceback(), calls=list(llm.calls), trace_id=trace_id, span_id=span_id
            ) from None
        except Exception as exc:  # AgentExit included: no agent may stop its worker
            if infra_failure() is not None:
                return done("error", error=f"LLM backend failed: {infra_failure()}")
            _record(span, exc)
            raise AgentFailure(
                _traceback(), calls=list(llm.calls), trace_id=trace_id, span_id=span_id
            ) from exc

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
            _record(span, exc)
            raise AgentFailure(
                _traceback(), calls=list(llm.calls), trace_id=trace_id, span_id=span_id
            ) from exc
        span.set_attribute("agentarium.reward", reward)
        return done("ok", reward=reward, metrics=metrics)
