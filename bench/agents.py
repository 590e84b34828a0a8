"""Agents only the benchmarks use (imported by consumer processes of any checkout: the bench
puts this directory on their PYTHONPATH, so before/after runs execute the same agent)."""

from __future__ import annotations


async def noop(task: dict, llm) -> float:
    """No LLM call and no thread: the pipeline's own ceiling for async agents."""
    return 0.0
