"""The chaos runs' agent: it writes one line per execution to a side channel before doing any
work, so a run counts how often each job's agent really ran (the server already refuses a
second trajectory, so stored trajectories cannot show redone work).

The channel is an append-only file named by ``AGENTARIUM_CHAOS_LOG``, shared by every consumer
process of a run: each execution is one ``os.write`` of one short line on an ``O_APPEND``
descriptor, which the kernel appends whole, so lines from concurrent processes never mix.
Line: ``<task key> <pid> <unix time>``.

A consumer process started with ``AGENTARIUM_CHAOS_HOLD_S`` holds every job it runs at least
that long: a process that is to die mid-rollout keeps its jobs until it is killed, while the
process that reruns them afterwards (without the variable) finishes them at once.
"""

from __future__ import annotations

import asyncio
import os
import time

LOG_ENV = "AGENTARIUM_CHAOS_LOG"
HOLD_ENV = "AGENTARIUM_CHAOS_HOLD_S"

_fds: dict[str, int] = {}


def record(key: object) -> None:
    path = os.environ[LOG_ENV]
    fd = _fds.get(path)
    if fd is None:
        fd = _fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{key} {os.getpid()} {time.time():.6f}\n".encode())


async def counted(task: dict, llm) -> float:
    """Record the execution, make one LLM call, then hold the job for ``task["sleep"]`` s (or
    this process's ``AGENTARIUM_CHAOS_HOLD_S``, if longer)."""
    record(task["key"])
    await llm.chat([{"role": "user", "content": f"job {task['key']}"}], max_new_tokens=2)
    hold = float(os.environ.get(HOLD_ENV, 0.0))
    await asyncio.sleep(max(float(task.get("sleep", 0.0)), hold))
    return 1.0
