"""A one-line progress bar for batches of rollouts, drawn only on a terminal.

``update`` may be called from any thread; off a terminal nothing is drawn, so logs and CI
output stay clean (``every_s`` prints a plain line periodically instead, when set).
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO

from schemas import Trajectory


class ProgressBar:
    def __init__(
        self,
        total: int,
        *,
        label: str = "rollouts",
        stream: IO[str] | None = None,
        enabled: bool | None = None,
        every_s: float | None = None,
        width: int = 30,
    ) -> None:
        self.total = total
        self.label = label
        self.stream = stream or sys.stderr
        self.tty = enabled if enabled is not None else _isatty(self.stream)
        self.every_s = every_s
        self.width = width
        self.done = 0
        self.counts = {"ok": 0, "error": 0, "timeout": 0}
        self.reward_sum = 0.0
        self._started = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()

    def update(self, trajectory: Trajectory) -> None:
        with self._lock:
            self.done += 1
            self.counts[trajectory.status] = self.counts.get(trajectory.status, 0) + 1
            if trajectory.status == "ok" and trajectory.reward is not None:
                self.reward_sum += trajectory.reward
            self._draw()

    def line(self) -> str:
        filled = int(self.width * self.done / max(self.total, 1))
        bar = "#" * filled + "." * (self.width - filled)
        elapsed = max(time.monotonic() - self._started, 1e-9)
        ok = self.counts["ok"]
        mean = self.reward_sum / ok if ok else 0.0
        return (
            f"[{bar}] {self.done}/{self.total} {self.label}  ok={ok} "
            f"error={self.counts['error']} timeout={self.counts['timeout']} "
            f"reward={mean:.3f}  {self.done / elapsed:.1f}/s"
        )

    def _draw(self) -> None:
        now = time.monotonic()
        final = self.done >= self.total
        if self.tty:
            if final or now - self._last > 0.1:
                self._last = now
                self.stream.write("\r" + self.line() + ("\n" if final else ""))
                self.stream.flush()
        elif self.every_s is not None and (final or now - self._last > self.every_s):
            self._last = now
            self.stream.write(self.line() + "\n")
            self.stream.flush()

    def close(self) -> None:
        with self._lock:
            if self.tty and self.done < self.total:
                self.stream.write("\n")
                self.stream.flush()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
