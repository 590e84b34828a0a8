"""The toy agents the CPU demo runs: answer a short prompt about a digit.

Tasks look like ``{"task_id": "d7-0", "prompt": "repeat 7", "answer": "7"}``, or are rows of a
verl dataset: ``prompt`` a list of chat messages, the answer in ``reward_model.ground_truth``.
``rollout``'s reward is 1.0 when the reply starts with the answer, else 0.0: it depends on the
prompt, so no constant output scores well.

``any_digit`` is the task a TRL run learns in 20 steps (``examples/trl_trainer.py``): whatever the
prompt, the reward is 1.0 when the reply starts with a digit (10 of the tiny model's 263 tokens,
so a random policy scores about 0.04), else 0.0.

``delayed_rollout`` is ``rollout`` followed by a wait drawn from a lognormal distribution
(``bench/async_vs_sync.py``: the long tail of agentic rollouts, tools and environments that take
seconds, sometimes ten times the usual).

``next_digit`` is the multi-task demo's second task (``{"prompt": "next 3", "answer": "4"}``,
9 wraps to 0) with a graded reward: 1.0 for the answer, 0.5 for a digit one away from it
(echoing the prompt's digit, what the repeat task teaches, earns half), 0.0 otherwise.
"""

from __future__ import annotations

import asyncio
import math
import random


def messages_of(task: dict) -> list[dict]:
    prompt = task["prompt"]
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)


def answer_of(task: dict) -> str:
    if "answer" in task:
        return str(task["answer"])
    return str(task["reward_model"]["ground_truth"])  # verl's rule-based reward field


async def rollout(task: dict, llm) -> dict:
    result = await llm.chat(messages_of(task), max_new_tokens=task.get("max_new_tokens") or 4)
    reply = result.text.strip()
    answer = answer_of(task)
    return {
        "reward": 1.0 if reply.startswith(answer) else 0.0,
        "metrics": {"reply_chars": float(len(reply))},
    }


async def any_digit(task: dict, llm) -> dict:
    result = await llm.chat(messages_of(task), max_new_tokens=task.get("max_new_tokens") or 1)
    reply = result.text.strip()
    return {
        "reward": 1.0 if reply[:1].isdigit() else 0.0,
        "metrics": {"reply_chars": float(len(reply))},
    }


_DELAYS = random.Random()  # one stream per consumer process; the bench compares distributions


async def delayed_rollout(task: dict, llm) -> dict:
    """``rollout``, then ``asyncio.sleep`` for a lognormal time with median
    ``task["delay_median_s"]`` and shape ``task["delay_sigma"]`` (p99 = median x e^(2.33 sigma)),
    after the model's reply: the reply keeps the policy version it was sampled with while the
    rest of the rollout (an environment, a tool, a judge) takes its time."""
    result = await rollout(task, llm)
    median, sigma = float(task.get("delay_median_s", 0.0)), float(task.get("delay_sigma", 0.0))
    delay = _DELAYS.lognormvariate(math.log(median), sigma) if median > 0 else 0.0
    await asyncio.sleep(delay)
    result["metrics"]["delay_s"] = delay
    return result


async def next_digit(task: dict, llm) -> dict:
    result = await llm.chat(messages_of(task), max_new_tokens=task.get("max_new_tokens") or 4)
    reply = result.text.strip()
    return {
        "reward": digit_credit(reply[:1], answer_of(task)),
        "metrics": {"reply_chars": float(len(reply))},
    }


def digit_credit(reply: str, answer: str) -> float:
    """1.0 for the answer, 0.5 for a digit one away from it (around the dial: 9 and 0 are
    neighbours), 0.0 for anything else."""
    if reply == answer:
        return 1.0
    if reply.isdigit() and len(reply) == 1 and (int(reply) - int(answer)) % 10 in (1, 9):
        return 0.5
    return 0.0


def noop(task: dict, llm) -> float:
    """No LLM call at all: measures the pipeline's own overhead (bench/)."""
    return 0.0


async def one_call(task: dict, llm) -> float:
    """One LLM call, reward 0: measures rollouts/s end to end (bench/)."""
    await llm.chat(
        [{"role": "user", "content": task.get("prompt", "hi")}],
        max_new_tokens=task.get("max_new_tokens", 1),
    )
    return 0.0
