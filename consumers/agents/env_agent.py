"""The generic function-call agent: any environment service as an RL task, without user code.

    agentarium consumer --agent db --env sql --llm URL      # the CLI builds env_agent("sql")

Each rollout opens a session of the environment on the job's task and loops: the model chats
with the conversation so far and the environment's tools (the tracing client renders the tools
into the prompt with the model's chat template and records every call token by token), the
assistant message (its tool calls parsed from the generated text) goes to ``env.step``, and
the tool results join the conversation. The loop ends when the environment says ``done``,
after ``max_turns`` model calls, or when the conversation no longer fits the model's context;
the last two are ``truncated``. The reward is the score of the session's outcome at close.

Tool results reach the model only as the prompt of its next call, so they are tokens of a
later ``prompt_ids``, never of a ``response_ids``: the trainer's loss mask leaves them out
(trainer/rows.py). Environment failures are the client's (consumers/agents/envclient.py): a lost
worker is retried and never scored, an environment that raised is an agent error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agentarium.schemas import check_name

from ..errors import BadRequest
from .envclient import EnvClient

DEFAULT_MAX_TURNS = 10

# How SGLang (and the local engine) word a prompt that does not fit the model's context:
# "... longer than the model's context length", "... exceeds the model's maximum context length".
_CONTEXT_FULL = "context length"


@dataclass(frozen=True)
class EnvAgent:
    """``async (task, llm, envs) -> {"reward", "metrics"}``, for environment ``env``.

    Plain data, so a ``ConsumerSpec`` holding one pickles for a Ray actor. Metrics: ``turns``
    (model calls), ``steps`` (environment steps), ``env_score``, ``done`` and ``truncated``
    (0 or 1), ``context_full`` (the conversation outgrew the model), ``tool_calls``,
    ``tool_call_errors`` (blocks the parser could not read), ``cut_observations`` (steps whose
    observation the worker cut), and the outcome's own metrics as ``env_<name>``.
    """

    env: str
    max_turns: int = DEFAULT_MAX_TURNS

    def __post_init__(self) -> None:
        check_name(self.env, "env")
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ValueError(f"max_turns must be an integer, got {self.max_turns!r}")
        if self.max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {self.max_turns}")

    async def __call__(self, task: dict, llm: Any, envs: EnvClient) -> dict:
        turns = tool_calls = tool_call_errors = cut = 0
        context_full = False
        async with envs.session(self.env, task) as session:
            assert session.observation is not None, "a started session has its observation"
            messages = list(session.observation.messages)
            tools = list(session.observation.tools) or None
            while not session.done and turns < self.max_turns:
                try:
                    reply = await llm.chat(messages, tools=tools)
                except BadRequest as exc:
                    # A conversation that outgrew the model ends like one out of turns; a
                    # first prompt that never fitted is the task's problem: the agent fails.
                    if turns == 0 or _CONTEXT_FULL not in str(exc):
                        raise
                    context_full = True
                    break
                turns += 1
                tool_calls += len(reply.tool_calls)
                tool_call_errors += len(reply.tool_call_errors)
                result = await session.step(reply.message)
                cut += int(result.truncated)
                messages += [reply.message, *result.messages]
        outcome = session.outcome
        assert outcome is not None, "the session closed on leaving its block"
        metrics = {f"env_{k}": float(v) for k, v in outcome.metrics.items()}
        metrics.update(
            turns=float(turns),
            steps=float(session.seq),
            env_score=float(outcome.score),
            done=float(session.done),
            truncated=float(not session.done),
            context_full=float(context_full),
            tool_calls=float(tool_calls),
            tool_call_errors=float(tool_call_errors),
            cut_observations=float(cut),
        )
        return {"reward": float(outcome.score), "metrics": metrics}


def env_agent(env: str, *, max_turns: int = DEFAULT_MAX_TURNS) -> EnvAgent:
    """The generic function-call agent for environment ``env`` (``agentarium env serve``)."""
    return EnvAgent(env, max_turns)
