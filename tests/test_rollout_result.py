"""A rollout's verdict as a table: (what its stage came to, the facts seen under it) → how
it ends.

Pure: no agent, no broker. tests/test_worker.py checks that the worker carries the results
out (stored, retried, dead-lettered), against a real nats-server.
"""

from __future__ import annotations

import asyncio

import pytest

from agentarium.consumers.agents.loading import RewardError
from agentarium.consumers.errors import (
    BackendUnavailable,
    EnvironmentTimeout,
    EnvironmentUnavailable,
)
from agentarium.consumers.rollout import AgentExit
from agentarium.consumers.rollout_result import Ending, Happened, Stage, Verdict, judge

BACKEND = BackendUnavailable("all 2 SGLang server(s) failed after retries")
SDK_ERROR = RuntimeError("APIStatusError: 503")  # an agent's SDK rewording the proxy's 503
ENV = EnvironmentUnavailable("no sql worker has room")
ENV_TIMEOUT = EnvironmentTimeout("the sql worker did not answer")  # a TimeoutError too
AGENT_TIMEOUT = TimeoutError("the agent's own wait")  # not the job's deadline


class Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("no")


class UnprintableEnv(EnvironmentUnavailable):
    def __str__(self) -> str:
        raise RuntimeError("no")


def agent(exc: BaseException | None = None, **facts) -> Happened:
    return Happened(stage=Stage.AGENT, exc=exc, deadline_s=30.0, **facts)


def reward(exc: BaseException | None = None, **facts) -> Happened:
    return Happened(stage=Stage.REWARD, exc=exc, deadline_s=30.0, **facts)


def ends(ending: Ending, error: str = "") -> Verdict:
    return Verdict(ending=ending, error=error)


OK = ends(Ending.OK)
FAILED = ends(Ending.AGENT_FAILED)
RELEASED = ends(Ending.RELEASED)
TIMEOUT = ends(Ending.TIMEOUT, "rollout exceeded its deadline of 30s")
BACKEND_FAILED = ends(Ending.BACKEND_FAILED, f"LLM backend failed: {BACKEND}")
ENV_LOST = ends(Ending.ENVIRONMENT_LOST, f"environment unavailable: {ENV}")

# (name, what happened, verdict)
CASES = [
    # -- the agent returned
    ("returned: on to the reward", agent(), OK),
    ("returned, a swallowed backend failure", agent(backend_error=BACKEND), OK),
    ("returned, a swallowed environment failure", agent(env_error=ENV), ENV_LOST),
    # -- the deadline passed: an outcome, whatever else went wrong meanwhile
    ("deadline", agent(TimeoutError(), deadline_expired=True), TIMEOUT),
    (
        "deadline while the fleet failed",
        agent(TimeoutError(), deadline_expired=True, backend_error=BACKEND),
        TIMEOUT,
    ),
    (
        "deadline, environment lost",
        agent(TimeoutError(), deadline_expired=True, env_error=ENV),
        TIMEOUT,
    ),
    # -- the agent's own TimeoutError is not the deadline
    ("the agent's own timeout", agent(AGENT_TIMEOUT), FAILED),
    (
        "its own timeout, the fleet failed",
        agent(AGENT_TIMEOUT, backend_error=BACKEND),
        BACKEND_FAILED,
    ),
    ("its own timeout, environment lost", agent(AGENT_TIMEOUT, env_error=ENV), ENV_LOST),
    (
        "an environment timeout, nothing recorded",
        agent(ENV_TIMEOUT),
        FAILED,
    ),
    # -- the LLM backend failed: infrastructure, recorded, never the agent's fault
    ("backend failure raised", agent(BACKEND), BACKEND_FAILED),
    (
        "backend failure reworded by the SDK",
        agent(SDK_ERROR, backend_error=BACKEND),
        BACKEND_FAILED,
    ),
    (
        "backend failure raised wins over an environment's",
        agent(BACKEND, env_error=ENV),
        BACKEND_FAILED,
    ),
    (
        "a swallowed backend failure wins over an environment's",
        agent(SDK_ERROR, backend_error=BACKEND, env_error=ENV),
        BACKEND_FAILED,
    ),
    (
        "the raised backend failure's text, not the last seen",
        agent(BackendUnavailable("the raised one"), backend_error=BACKEND),
        ends(Ending.BACKEND_FAILED, "LLM backend failed: the raised one"),
    ),
    # -- an environment service failed: infrastructure, retried
    ("environment failure raised", agent(ENV), ENV_LOST),
    ("environment failure, the agent raised another", agent(SDK_ERROR, env_error=ENV), ENV_LOST),
    (
        "the recorded environment failure's text wins",
        agent(EnvironmentUnavailable("raised"), env_error=ENV),
        ENV_LOST,
    ),
    (
        "an unprintable environment failure",
        agent(UnprintableEnv("")),
        ends(
            Ending.ENVIRONMENT_LOST,
            "environment unavailable: <UnprintableEnv: its message cannot be printed>",
        ),
    ),
    # -- the agent raised: its failure, retried by the delivery policy
    ("the agent raised", agent(ValueError("bug")), FAILED),
    ("the agent exited", agent(AgentExit("SystemExit")), FAILED),
    ("unprintable", agent(Unprintable()), FAILED),
    # -- cancellation: a drain's goes on; the agent's own CancelledError is its bug
    ("a drain", agent(asyncio.CancelledError(), cancelled=True), RELEASED),
    (
        "a drain while the fleet failed",
        agent(asyncio.CancelledError(), cancelled=True, backend_error=BACKEND),
        RELEASED,
    ),
    ("the agent raised CancelledError", agent(asyncio.CancelledError()), FAILED),
    # -- the reward function: only its own failure counts
    ("reward found", reward(), OK),
    ("reward not finite", reward(RewardError("reward is nan")), FAILED),
    ("reward function raised", reward(KeyError("score")), FAILED),
    ("reward function exited", reward(SystemExit(1)), FAILED),
    ("reward, a swallowed backend failure", reward(ValueError(), backend_error=BACKEND), FAILED),
    ("reward, environment lost before", reward(ValueError(), env_error=ENV), FAILED),
    ("a drain in the reward", reward(asyncio.CancelledError(), cancelled=True), RELEASED),
    ("the reward raised CancelledError", reward(asyncio.CancelledError()), FAILED),
]


@pytest.mark.parametrize(
    ("happened", "expected"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_verdict_table(happened, expected):
    assert judge(happened) == expected


def test_the_table_covers_every_ending():
    assert {case[2].ending for case in CASES} == set(Ending)


def test_only_the_agents_stage_times_out_or_fails_for_infrastructure():
    for _, happened, verdict in CASES:
        if happened.stage is Stage.REWARD:
            assert verdict.ending in (Ending.OK, Ending.AGENT_FAILED, Ending.RELEASED)
        if verdict.ending in (Ending.OK, Ending.AGENT_FAILED, Ending.RELEASED):
            assert verdict.error == ""  # an agent failure's text is its traceback, built later
