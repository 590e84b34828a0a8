"""The toy agent the CPU demo runs: answer a short prompt, scored by exact match.

Tasks look like ``{"task_id": "d7-0", "prompt": "repeat 7", "answer": "7"}``. The reward
is 1.0 when the reply starts with the answer, else 0.0: it depends on the prompt, so no
constant output scores well.
"""

from __future__ import annotations


async def rollout(task: dict, llm) -> dict:
    result = await llm.chat(
        [{"role": "user", "content": task["prompt"]}], max_new_tokens=task.get("max_new_tokens", 4)
    )
    reply = result.text.strip()
    answer = str(task["answer"])
    return {
        "reward": 1.0 if reply.startswith(answer) else 0.0,
        "metrics": {"reply_chars": float(len(reply))},
    }


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
