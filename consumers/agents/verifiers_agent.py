"""verifiers environments as agents: an environment written for ``verifiers`` runs unchanged.

``verifiers_agent(env)`` wraps an environment of verifiers' classic API (``SingleTurnEnv``,
``ToolEnv``, ``MultiTurnEnv``..., ``import verifiers as vf``; verifiers 0.3 keeps it as
``verifiers.legacy``) as an endpoint-style agent, ``rollout(task, endpoint, model)``. For each
job it points an ``openai.AsyncOpenAI`` client at the rollout's tracing endpoint, runs
``env.rollout(input, client, model, sampling_args)`` on the job's task row and scores the
final state with the environment's rubric (``rubric.score_rollout``), as verifiers' own
``run_rollout`` does. Every model call goes through the tracing proxy, so the trajectory holds
each call's tokens; the reward and the metrics are the rubric's.

From the CLI, an agent spec names one: ``NAME=verifiers:ENV_ID`` (an installed verifiers
environment, ``vf.load_environment(ENV_ID)``) or ``NAME=verifiers:module:function`` (a function
that returns the environment). verifiers is an optional extra (``agentarium[verifiers]``),
imported only when such an agent is built.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable
from typing import Any

from .loading import AgentLoadError, load_callable

SPEC_PREFIX = "verifiers:"
_CLIENT_TIMEOUT_S = 3600.0  # the rollout's deadline cuts a call first


class VerifiersRolloutError(RuntimeError):
    """The verifiers rollout ended with an error in its state (a model call or the
    environment failed): the rollout is not scored. A backend failure behind it makes the
    rollout an infrastructure error; otherwise the worker retries it as an agent failure."""


def _verifiers() -> Any:
    try:
        import verifiers as vf
    except ImportError as exc:
        raise AgentLoadError(
            "verifiers is not installed: pip install 'agentarium[verifiers]' (verifiers 0.3)"
        ) from exc
    return vf


def load_verifiers_agent(spec: str) -> VerifiersAgent:
    """The agent for ``verifiers:ENV_ID`` or ``verifiers:module:function`` (the prefix may be
    given or not)."""
    target = spec.removeprefix(SPEC_PREFIX)
    if not target:
        raise AgentLoadError(
            "agent 'verifiers:' names no environment: write verifiers:ENV_ID or "
            "verifiers:module:function"
        )
    vf = _verifiers()
    if ":" in target:
        env = _keeping_signal_handlers(load_callable(target, "verifiers environment loader"))
    else:
        try:
            env = _keeping_signal_handlers(lambda: vf.load_environment(target))
        except (ValueError, RuntimeError) as exc:
            raise AgentLoadError(f"verifiers environment {target!r}: {exc}") from exc
    return verifiers_agent(env, name=target)


def _keeping_signal_handlers(build: Callable[[], Any]) -> Any:
    """Build the environment, then put back the process's SIGINT and SIGTERM handlers: a
    verifiers environment installs its own (SIGTERM exits at once), and a consumer must drain
    instead. Its teardown still runs at exit (verifiers registers it with atexit)."""
    if threading.current_thread() is not threading.main_thread():
        return build()  # only the main thread can set handlers: verifiers cannot either
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return build()
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)


def verifiers_agent(
    env: Any, *, sampling_args: dict[str, Any] | None = None, name: str = ""
) -> VerifiersAgent:
    """Wrap the verifiers environment ``env`` as an agent.

    Sampling: the job's (its ``sampling``, applied by the tracing endpoint to every call);
    ``sampling_args`` (verifiers' names: ``max_tokens``, ``temperature``...) override it per
    call. The environment's own ``sampling_args`` defaults are not sent: the job, the caller
    here, sets them, as a caller's sampling arguments win over them in verifiers.
    """
    return VerifiersAgent(env, sampling_args=sampling_args, name=name)


class VerifiersAgent:
    """``await agent(task, endpoint, model)`` -> ``{"reward": r, "metrics": {...}}``."""

    def __init__(
        self, env: Any, *, sampling_args: dict[str, Any] | None = None, name: str = ""
    ) -> None:
        rubric = getattr(env, "rubric", None)
        if rubric is None or not callable(getattr(env, "rollout", None)):
            raise AgentLoadError(
                f"{env!r} is not a verifiers environment (it needs rollout() and a rubric)"
            )
        if getattr(rubric, "has_group_rewards", False):
            raise AgentLoadError(
                f"the rubric of verifiers environment {name or env!r} has group-level reward "
                "functions (they score the G samples of a group together); each Agentarium job "
                "is one rollout, scored alone: use per-rollout reward functions (the trainer "
                "normalizes rewards within the group)"
            )
        self.env = env
        self.sampling_args = dict(sampling_args or {})
        self.name = name or type(env).__name__
        self.__name__ = f"verifiers:{self.name}"  # what logs and AgentSpec show

    async def __call__(self, task: dict, endpoint: str, model: str) -> dict:
        from openai import AsyncOpenAI

        vf = _verifiers()
        row = rollout_input(self.env, task)
        http = AsyncOpenAI(
            base_url=endpoint, api_key="agentarium", max_retries=0, timeout=_CLIENT_TIMEOUT_S
        )
        client = vf.OpenAIChatCompletionsClient(http)
        try:
            state = await self.env.rollout(row, client, model, dict(self.sampling_args))
            if getattr(self.env, "score_rollouts", True):
                await self.env.rubric.score_rollout(state)
            else:
                await self.env.rubric.dummy_score_rollout(state)
            await self.env.rubric.cleanup(state)
        finally:
            await http.close()
        error = state.get("error")
        if error is not None:
            cause = error if isinstance(error, BaseException) else None
            raise VerifiersRolloutError(f"the verifiers rollout failed: {error!r}") from cause
        return {"reward": state.get("reward"), "metrics": dict(state.get("metrics") or {})}

    def __repr__(self) -> str:
        return f"VerifiersAgent({self.name})"


def rollout_input(env: Any, task: dict) -> dict:
    """verifiers' ``RolloutInput`` for a job's task row.

    - ``prompt`` as chat messages: the row as it is (a verifiers dataset row: ``prompt``,
      ``answer``, ``info``, ``task``, ``example_id``);
    - ``question`` (or ``prompt`` as a string): the prompt is built as verifiers builds its
      dataset's, the environment's system prompt and few-shot turns before the question;
    - only ``example_id``: that row of the environment's dataset (``"split": "eval"`` for
      its eval dataset).
    """
    if not isinstance(task, dict):
        raise TypeError(f"a verifiers task row is a dict, got {type(task).__name__}")
    row = dict(task)
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        pass
    elif isinstance(prompt, str) or isinstance(row.get("question"), str):
        question = prompt if isinstance(prompt, str) else row["question"]
        messages: list[dict] = []
        if getattr(env, "system_prompt", None):
            messages.append({"role": "system", "content": env.system_prompt})
        messages.extend(getattr(env, "few_shot", None) or [])
        messages.append({"role": "user", "content": question})
        row["prompt"] = messages
    elif isinstance(row.get("example_id"), int):
        split = env.get_eval_dataset() if row.get("split") == "eval" else env.get_dataset()
        row = {**dict(split[row["example_id"]]), **{k: v for k, v in row.items() if k != "split"}}
    else:
        raise ValueError(
            "a verifiers task row needs 'prompt' (chat messages), 'question', or the "
            "'example_id' of a row of the environment's dataset"
        )
    row.setdefault("example_id", 0)
    return row
