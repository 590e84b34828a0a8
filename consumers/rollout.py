"""One rollout: run the agent on a job under a ``rollout`` span and build its Trajectory.

Outcomes are classified here, once:
  ok        the agent returned and a finite reward was found
  timeout   the job's deadline passed (calls made so far are kept)
  error     infrastructure failed (the LLM backend was unreachable after retries):
            recorded, never scored as reward 0
  agent error (AgentFailure)  the agent or reward function raised: the worker retries it

The deadline (``job.deadline_s``) stands still while the agent's LLM fleet is down and holds
its calls (consumers/fleet.py): an outage within ``--fleet-outage-limit`` costs a rollout
neither its attempt nor its time.
"""

from __future__ import annotations

import asyncio
import json
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.util.types import AttributeValue

from broker import OPENINFERENCE_SPAN_KIND, span_id_hex, trace_id_hex
from schemas import Job, Trajectory

from . import genai
from .agents import AgentRunner, extract_reward, finite_reward
from .errors import BackendUnavailable
from .fleet import Fleet, deadline_held_by
from .llm import TracingLLM
from .proxy import secret_of

tracer = trace.get_tracer("agentarium.consumers")


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
    # The LLM fleets behind ``backend`` (the model's, a cross-sampling model's): while one is
    # down within its outage limit, the worker pulls nothing and rollout deadlines stand still.
    fleets: tuple[Fleet, ...] = ()


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

        deadline = asyncio.timeout(job.deadline_s)
        secret = ""  # the endpoint's: scrubbed from whatever the agent's failure says

        def failure(exc: BaseException) -> AgentFailure:
            """The agent's failure, its text and span event without the endpoint's secret. The
            caller raises it ``from None``: a chained cause would carry the raw text along."""
            text, message = traceback.format_exc(), str(exc)
            if secret:
                text, message = text.replace(secret, "***"), message.replace(secret, "***")
            span.record_exception(
                exc, attributes={"exception.message": message, "exception.stacktrace": text}
            )
            return AgentFailure(text, calls=list(llm.calls), trace_id=trace_id, span_id=span_id)

        try:
            with env.proxy.register(job.job_id, llm) as endpoint:
                secret = secret_of(endpoint)
                async with deadline:
                    with deadline_held_by(env.fleets, deadline):
                        result = await env.runner.run(job.task, llm=llm, endpoint=endpoint)
        except TimeoutError as exc:
            if deadline.expired():
                return done(
                    "timeout", error=f"rollout exceeded its deadline of {job.deadline_s:g}s"
                )
            if infra_failure() is not None:
                return done("error", error=f"LLM backend failed: {infra_failure()}")
            raise failure(exc) from None
        except BackendUnavailable as exc:
            return done("error", error=f"LLM backend failed: {exc}")
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if infra_failure() is not None:
                return done("error", error=f"LLM backend failed: {infra_failure()}")
            raise failure(exc) from None

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
        except Exception as exc:  # RewardError or a failing reward function
            raise failure(exc) from None
        span.set_attribute("agentarium.reward", reward)
        return done("ok", reward=reward, metrics=metrics)
