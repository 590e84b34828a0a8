"""Agents used by the tests (imported by module path in consumer subprocesses too)."""

from __future__ import annotations

import asyncio
import time


def add_tool(description: str = "Add two numbers", params: tuple[str, ...] = ("a", "b")) -> dict:
    """The OpenAI-style function tool the tool-calling tests offer: ``add`` over numbers."""
    properties = {name: {"type": "number"} for name in params}
    return {
        "type": "function",
        "function": {
            "name": "add",
            "description": description,
            "parameters": {"type": "object", "properties": properties},
        },
    }


async def echo(task: dict, llm) -> dict:
    result = await llm.chat(
        [{"role": "user", "content": task.get("prompt", "hi")}],
        max_new_tokens=task.get("max_new_tokens", 3),
    )
    return {"reward": float(len(result.call.response_ids) % 2), "metrics": {"calls": 1.0}}


async def slow(task: dict, llm) -> float:
    await llm.chat([{"role": "user", "content": task.get("prompt", "hi")}], max_new_tokens=2)
    await asyncio.sleep(task.get("sleep", 0.3))
    return 1.0


STALLED_RUNS: dict[int, int] = {}  # task n -> runs started (stalls)


async def stalls(task: dict, llm) -> float:
    """Blocks its worker's event loop for ``block`` seconds (a synchronous call in an async
    agent), then runs ``after`` seconds more: a process that misses its heartbeats while a job
    runs. Counts its runs in ``STALLED_RUNS``."""
    STALLED_RUNS[task["n"]] = STALLED_RUNS.get(task["n"], 0) + 1
    await llm.chat([{"role": "user", "content": "hi"}], max_new_tokens=2)
    time.sleep(task["block"])  # noqa: ASYNC251 - the stall is the point
    await asyncio.sleep(task.get("after", 1.0))
    return 1.0


async def always_raises(task: dict, llm) -> float:
    raise RuntimeError(f"agent bug on task {task.get('n')}")


async def flaky(task: dict, llm) -> float:
    """Fails on the first delivery of each job, then succeeds."""
    key = task["n"]
    flaky.seen.setdefault(key, 0)
    flaky.seen[key] += 1
    if flaky.seen[key] == 1:
        raise ValueError("transient agent failure")
    await llm.chat([{"role": "user", "content": "x"}], max_new_tokens=1)
    return 0.5


flaky.seen = {}


async def no_reward(task: dict, llm) -> dict:
    return {"answer": 42}


async def hangs(task: dict, llm) -> float:
    await asyncio.Event().wait()
    return 1.0


def sync_agent(task: dict, llm) -> float:
    result = llm.chat([{"role": "user", "content": "sync"}], max_new_tokens=2)
    return float(len(result.call.response_ids))


async def with_own_span(task: dict, llm) -> float:
    """An agent that traces its own work: its span must nest under the rollout span."""
    from opentelemetry import trace

    with trace.get_tracer("user.agent").start_as_current_span("agent thinking"):
        await llm.chat([{"role": "user", "content": "x"}], max_new_tokens=1)
    return 1.0


async def three_turns(task: dict, llm) -> float:
    """Three calls in one conversation (with cross-sampling, turns of both models mix)."""
    messages = [{"role": "user", "content": task.get("prompt", "hi")}]
    for _ in range(3):
        result = await llm.chat(messages, max_new_tokens=4)
        messages += [result.message, {"role": "user", "content": "and then?"}]
    return float(task.get("n", 0))


async def scored(task: dict, llm) -> float:
    """Scores by the task: a ``flat`` task gives every sample 1.0 (a group with no signal);
    any other alternates 0 and 1 over its samples. ``max_new_tokens`` is passed on, so a small
    one cuts the reply (finish_reason length)."""
    await llm.chat(
        [{"role": "user", "content": task.get("prompt", "x")}],
        max_new_tokens=task.get("max_new_tokens", 8),
    )
    if task.get("flat"):
        return 1.0
    key = task["task_id"]
    scored.seen[key] = scored.seen.get(key, 0) + 1
    return float(scored.seen[key] % 2)


scored.seen = {}
