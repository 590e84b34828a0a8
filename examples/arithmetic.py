"""Single-digit addition with an exact-answer reward: the real-model demo's task
(``agentarium demo --model smol``).

Tasks look like ``{"task_id": "add-3-5", "a": 3, "b": 5, "answer": "8"}``. The prompt is a
short system message and two solved examples (few-shot, as chat turns: ``2 + 3 =`` -> ``5``),
59 tokens in all, so SmolLM2-135M-Instruct answers with a bare number often enough for GRPO's
groups to have spread: 0.14 exact on the held-out pairs at temperature 1 (8 samples each, 13
of 20 pairs with some right and some wrong), where a strict reward on the bare question starts
near 0 (a chatty reply never equals the answer). The reward is 1.0 when the reply, stripped,
is exactly the sum, else 0.0.

``add_tasks`` draws tasks from the 100 ordered pairs (a, b), ``held_out`` keeps 20 of them out
of training (every pair with (a + 2b) % 5 == 0), so an eval on them measures what was learnt
rather than what was seen.
"""

from __future__ import annotations

import random

SYSTEM = "Answer with the number only."
SHOTS = ((2, 3), (4, 4))  # the solved examples every prompt starts with
QUESTION = "{a} + {b} ="
MAX_NEW_TOKENS = 4  # a two-digit sum and <|im_end|> fit; a sentence does not


def held_out(a: int, b: int) -> bool:
    """The 20 pairs kept out of training (eval's tasks)."""
    return (a + 2 * b) % 5 == 0


def task(a: int, b: int, task_id: str) -> dict:
    return {"task_id": task_id, "a": a, "b": b, "answer": str(a + b)}


def add_tasks(rng: random.Random, n: int, prefix: str) -> list[dict]:
    """``n`` training tasks (pairs not held out), one rng draw per task."""
    pairs = [(a, b) for a in range(10) for b in range(10) if not held_out(a, b)]
    out = []
    for i in range(n):
        a, b = rng.choice(pairs)
        out.append(task(a, b, f"{prefix}-{i}"))
    return out


def eval_tasks() -> list[dict]:
    """Every held-out pair once."""
    return [task(a, b, f"add-{a}-{b}") for a in range(10) for b in range(10) if held_out(a, b)]


def messages_of(task: dict) -> list[dict]:
    messages: list[dict] = [{"role": "system", "content": SYSTEM}]
    for a, b in SHOTS:
        messages.append({"role": "user", "content": QUESTION.format(a=a, b=b)})
        messages.append({"role": "assistant", "content": str(a + b)})
    messages.append({"role": "user", "content": QUESTION.format(a=task["a"], b=task["b"])})
    return messages


async def rollout(task: dict, llm) -> dict:
    result = await llm.chat(messages_of(task), max_new_tokens=MAX_NEW_TOKENS)
    reply = result.text.strip()
    return {
        "reward": 1.0 if reply == task["answer"] else 0.0,
        "metrics": {"bare_number": float(reply.isdigit()), "reply_chars": float(len(reply))},
    }
