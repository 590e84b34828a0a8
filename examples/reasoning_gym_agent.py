"""An agent for reasoning-gym tasks: one chat call, the reward from the family's own scorer.

Serve each family under its own agent name, all with this function:

    agentarium consumer --agent basic_arithmetic=agentarium.examples.reasoning_gym_agent:rollout --llm URL
    agentarium consumer --agent leg_counting=agentarium.examples.reasoning_gym_agent:rollout --llm URL

Tasks come from ``python -m agentarium.examples.reasoning_gym_tasks``. The model is asked, with
reasoning-gym's default system prompt, to think and then put its final answer in
``<answer>...</answer>``; the last such block is the answer (reasoning-gym's
``extract_answer``) and the reward is ``score_answer(answer, entry)`` of the task's family,
in [0, 1], often with partial credit for a near miss. No answer block scores as reasoning-gym
scores ``None`` (0). Sampling, ``max_new_tokens`` included, is the job's (``agentarium produce
--max-new-tokens``): reasoning needs room on a real model, a CPU smoke test wants little.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

SYSTEM_PROMPT_STYLE = "default"  # a key of reasoning_gym.utils.SYSTEM_PROMPTS


@functools.cache
def _scorer(family: str) -> Callable[[Any, dict], float]:
    import reasoning_gym

    return reasoning_gym.get_score_answer_fn(family)


def entry_of(task: dict) -> dict:
    """The reasoning-gym entry a scorer expects, from a task row."""
    return {"question": task["question"], "answer": task["answer"], "metadata": task["metadata"]}


def score(task: dict, answer: str | None) -> float:
    """reasoning-gym's score of ``answer`` for ``task``, by the scorer of the task's family."""
    return float(_scorer(task["family"])(answer, entry_of(task)))


def messages_of(task: dict) -> list[dict]:
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return [
        {"role": "system", "content": SYSTEM_PROMPTS[SYSTEM_PROMPT_STYLE]},
        {"role": "user", "content": task["question"]},
    ]


async def rollout(task: dict, llm) -> dict:
    from reasoning_gym.utils import extract_answer

    result = await llm.chat(messages_of(task))
    answer = extract_answer(result.text)
    return {
        "reward": score(task, answer),
        "metrics": {
            "answered": float(answer is not None),
            "reply_chars": float(len(result.text)),
        },
    }
