"""A process stopped for certain: SIGSTOP reaches a running process asynchronously (each of its
threads stops when the kernel next interrupts it, on another core maybe after the kill call has
returned), so a test that means "the server answers nothing from now on" waits until every
thread of it is stopped before it sends anything."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path


def _all_stopped(pid: int) -> bool:
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            state = stat.read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # a thread that just ended
        if state not in ("T", "t"):
            return False
    return True


@contextlib.contextmanager
def frozen(pid: int, timeout_s: float = 10.0) -> Iterator[None]:
    """SIGSTOP ``pid`` and return once all its threads are stopped; SIGCONT on leaving."""
    os.kill(pid, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + timeout_s
        while not _all_stopped(pid):
            if time.monotonic() > deadline:
                raise TimeoutError(f"process {pid} did not stop within {timeout_s}s")
            time.sleep(0.001)
        yield
    finally:
        os.kill(pid, signal.SIGCONT)
