"""Counters: what one rollout worker did with its deliveries, for its log line, its registry
entry and the tests (arq's habit: a worker's repr shows them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Counters:
    fetched: int = 0
    completed: int = 0
    ok: int = 0
    errors: int = 0
    timeouts: int = 0
    retried: int = 0
    dead_lettered: int = 0
    already_stored: int = 0
    invalid: int = 0
    # Jobs a drain gave back unfinished, published again for another worker (not failures).
    released: int = 0
    # Deliveries of a job already running here (the broker missed its heartbeats): not run.
    redelivered_running: int = 0
    # Jobs that ended here without a usable rollout: stored as status error (the LLM fleet
    # failed) and/or dead-lettered, each job counted once. What a caller checks to report
    # failure (``errors`` misses dead letters; ``dead_lettered`` misses a dead fleet).
    failed: int = 0

    def stored(self, status: str) -> None:
        """A trajectory with ``status`` was stored."""
        self.completed += 1
        if status == "ok":
            self.ok += 1
        elif status == "timeout":
            self.timeouts += 1
        else:
            self.errors += 1
