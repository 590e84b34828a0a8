"""The chaos runs' agent: it writes one line per execution to a side channel before doing any
work, so a run counts how often each job's agent really ran (the server already refuses a
second trajectory, so stored trajectories cannot show redone work).

The channel is an append-only file named by ``AGENTARIUM_CHAOS_LOG``, shared by every consumer
process of a run: each execution is one ``os.write`` of one short line on an ``O_APPEND``
descriptor, which the kernel appends whole, so lines from concurrent processes never mix.
Line: ``<task key> <pid> <unix time>``.
"""

from __future__ import annotations

import asyncio
import os
import time

LOG_ENV = "AGENTARIUM_CHAOS_LOG"

_fds: dict[str, int] = {}


def record(key: object) -> None:
    path = os.environ[LOG_ENV]
    fd = _fds.get(path)
    if fd is None:
        fd = _fds[path] = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.write(fd, f"{key} {os.getpid()} {time.time():.6f}\n".encode())


async def counted(task: dict, llm) -> float:
    """Record the execution, make one LLM call, then hold the job for ``task["sleep"]`` s."""
    record(task["key"])
    await llm.chat([{"role": "user", "content": f"job {task['key']}"}], max_new_tokens=2)
    await asyncio.sleep(float(task.get("sleep", 0.0)))
    return 1.0
