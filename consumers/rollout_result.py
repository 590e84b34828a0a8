"""What one rollout came to, as a value: ``judge(Happened(...)) -> Verdict``, then a
``RolloutResult`` for the worker.

A rollout ends in one of these ways, decided here and nowhere else:

  ok              the agent returned and a finite reward was found
  timeout         the job's deadline passed (calls made so far are kept)
  backend failed  the LLM backend was unreachable after its retries, even if the agent
                  swallowed the error: infrastructure, recorded as status ``error``, never
                  scored as reward 0
  agent failed    the agent or its reward function raised: the worker retries it
  environment lost  an environment service was unavailable (no worker with room, or the
                  session's worker died), even if the agent swallowed the error: the worker
                  retries it; its last attempt is stored as status ``error``, never reward 0
  released        a drain cancelled the rollout: the cancellation goes on, no result

``judge`` is pure (tests/test_rollout_result.py reads its rules as a table); ``run_rollout``
(consumers/rollout.py) only gathers the facts and builds the trajectory it names.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from enum import Enum

from agentarium.schemas import Trajectory

from .errors import BackendUnavailable, EnvironmentUnavailable


class Stage(Enum):
    AGENT = "agent"  # the agent's run, under the deadline
    REWARD = "reward"  # the reward, once the agent returned


class Ending(Enum):
    OK = "ok"
    TIMEOUT = "timeout"
    BACKEND_FAILED = "backend_failed"
    AGENT_FAILED = "agent_failed"
    ENVIRONMENT_LOST = "environment_lost"
    RELEASED = "released"


@dataclass(frozen=True, kw_only=True)
class Happened:
    """What a stage of the rollout came to, and the facts the verdict needs."""

    stage: Stage = Stage.AGENT
    exc: BaseException | None = None  # what the stage raised; None: it returned
    deadline_expired: bool = False  # the job's deadline passed
    deadline_s: float = 0.0
    cancelled: bool = False  # someone cancelled the rollout (a drain), not the agent's code
    # The last failures seen under the rollout, raised or swallowed by the agent.
    backend_error: BackendUnavailable | None = None
    env_error: EnvironmentUnavailable | None = None


@dataclass(frozen=True, kw_only=True)
class Verdict:
    ending: Ending
    error: str = ""  # the trajectory's error text (an agent failure's is its traceback)


def judge(happened: Happened) -> Verdict:
    """How the rollout ends, given what its stage came to. ``OK`` after the agent's stage
    means: go on to the reward."""
    exc = happened.exc
    if exc is None:
        if happened.stage is Stage.AGENT and happened.env_error is not None:
            # swallowed by the agent: its reward may be a failed session's 0
            return _environment_lost(happened.env_error)
        return Verdict(ending=Ending.OK)
    if isinstance(exc, asyncio.CancelledError):
        # A drain cancels the rollout; an agent raising CancelledError itself has a bug.
        return Verdict(ending=Ending.RELEASED if happened.cancelled else Ending.AGENT_FAILED)
    if happened.stage is Stage.REWARD:
        return Verdict(ending=Ending.AGENT_FAILED)  # RewardError, or a failing reward function
    if isinstance(exc, TimeoutError) and happened.deadline_expired:
        return Verdict(
            ending=Ending.TIMEOUT,
            error=f"rollout exceeded its deadline of {happened.deadline_s:g}s",
        )
    backend = exc if isinstance(exc, BackendUnavailable) else happened.backend_error
    if backend is not None:
        # what the agent raised may be its SDK's rewording of the proxy's 503
        return Verdict(
            ending=Ending.BACKEND_FAILED, error=f"LLM backend failed: {message(backend)}"
        )
    if happened.env_error is not None:
        return _environment_lost(happened.env_error)
    if isinstance(exc, EnvironmentUnavailable):
        return _environment_lost(exc)
    return Verdict(ending=Ending.AGENT_FAILED)


def _environment_lost(error: BaseException) -> Verdict:
    return Verdict(
        ending=Ending.ENVIRONMENT_LOST, error=f"environment unavailable: {message(error)}"
    )


def message(exc: BaseException) -> str:
    """``str(exc)``, even for an exception whose ``str()`` raises."""
    try:
        return str(exc)
    except Exception:
        return f"<{type(exc).__name__}: its message cannot be printed>"


# ---- what the worker gets ----------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Finished:
    """A trajectory to store and ack: status ok, timeout, or error (the LLM backend failed)."""

    trajectory: Trajectory


@dataclass(frozen=True, kw_only=True)
class AgentFailed:
    """The agent (or its reward function) raised; retried by the worker's policy. ``error`` is
    the traceback, the endpoint's secret scrubbed from it."""

    error: str
    calls: list = field(default_factory=list)
    trace_id: str = ""
    span_id: str = ""


@dataclass(frozen=True, kw_only=True)
class EnvironmentLost:
    """An environment service failed under the rollout: infrastructure, retried by the worker;
    ``trajectory`` (status ``error``) is what its last attempt stores."""

    trajectory: Trajectory


RolloutResult = Finished | AgentFailed | EnvironmentLost
