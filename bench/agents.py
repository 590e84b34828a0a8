"""Agents only the benchmarks use (imported by consumer processes of any checkout: the bench
puts this directory on their PYTHONPATH, so before/after runs execute the same agent)."""

from __future__ import annotations


async def noop(task: dict, llm) -> float:
    """No LLM call and no thread: the pipeline's own ceiling for async agents."""
    return 0.0


async def one_http_call(task: dict, endpoint: str, model: str) -> dict:
    """The call bench/programs/one_call.py makes (one chat completion of one token through the
    rollout's gateway, a fresh connection), from inside the consumer: a program agent's cost
    without the processes (bench/program_rollouts.py)."""
    import aiohttp

    body = {
        "model": model,
        "messages": [{"role": "user", "content": task["prompt"]}],
        "max_tokens": 1,
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{endpoint}/chat/completions", json=body) as response:
            response.raise_for_status()
            await response.read()
    return {"reward": 0.0}
