"""An unmodified OpenAI-SDK agent: it only sees the per-rollout endpoint, and is traced
token by token by the consumer's proxy."""

from __future__ import annotations


def rollout(task: dict, endpoint: str, model: str) -> float:
    from openai import OpenAI

    # The endpoint names the rollout; the key is unused (any value works).
    client = OpenAI(base_url=endpoint, api_key="unused")
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": task["prompt"]}],
        max_tokens=task.get("max_new_tokens", 4),
        temperature=1.0,
    )
    text = (reply.choices[0].message.content or "").strip()
    return 1.0 if text.startswith(str(task["answer"])) else 0.0
