"""Progress lines drawn by tqdm: rewritten in place on a terminal; elsewhere silent, or one plain
line every ``every_s`` seconds, so logs and CI output hold no carriage returns.

``StatusLine`` is the general line (the demo's step counter); ``ProgressBar`` counts a batch's
trajectories by status. ``update``/``show`` may be called from any thread.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import IO, Any

from tqdm import tqdm

from agentarium.schemas import Trajectory


class _Tqdm(tqdm):
    """tqdm with a free-text ``{info}`` field in ``bar_format`` (tqdm documents overriding
    ``format_dict`` for custom fields)."""

    monitor_interval = 0  # no monitor thread: lines are redrawn on each update
    info = ""

    @property
    def format_dict(self) -> dict[str, Any]:
        return {**super().format_dict, "info": self.info}


class StatusLine:
    """``[#####.....] <n>/<total><unit>  <info> ...`` as tqdm's ``bar_format`` ``fmt`` lays it out."""

    def __init__(
        self,
        total: int,
        *,
        fmt: str,
        unit: str = "",
        stream: IO[str] | None = None,
        enabled: bool | None = None,
        every_s: float | None = None,
    ) -> None:
        self.total = total
        self.fmt = fmt
        self.unit = unit
        self.stream = stream or sys.stderr
        self.every_s = every_s
        self.n = 0
        self.info = ""
        self._started = time.monotonic()
        self._last = float("-inf")
        self._lock = threading.Lock()
        drawn = enabled if enabled is not None else _isatty(self.stream)
        self._bar = (
            _Tqdm(
                total=total,
                file=self.stream,
                unit=unit,
                bar_format=fmt,
                ascii=".#",
                mininterval=0.1,
                dynamic_ncols=True,
            )
            if drawn
            else None
        )

    def show(self, n: int, info: str, *, force: bool = False) -> None:
        with self._lock:
            self.n, self.info = n, info
            if self._bar is not None:
                self._bar.info = info
                if n != self._bar.n:
                    self._bar.update(n - self._bar.n)  # redraws at most every mininterval
                else:
                    self._bar.refresh()
                return
            now = time.monotonic()
            final = n >= self.total
            if self.every_s is not None and (force or final or now - self._last >= self.every_s):
                self._last = now
                self.stream.write(self.line() + "\n")
                self.stream.flush()

    def line(self) -> str:
        """The line as it stands, without a terminal."""
        return tqdm.format_meter(
            self.n,
            self.total,
            time.monotonic() - self._started,
            unit=self.unit,
            bar_format=self.fmt,
            ascii=".#",
            info=self.info,
        )

    def close(self) -> None:
        with self._lock:
            if self._bar is not None:
                self._bar.close()  # draws the final state and ends the line


class ProgressBar:
    """``[####....] 12/64 rollouts  ok=11 error=1 timeout=0 reward=0.412   3.10 rollouts/s  00:04``"""

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
        self.done = 0
        self.counts = {"ok": 0, "error": 0, "timeout": 0}
        self.reward_sum = 0.0
        self._lock = threading.Lock()
        self._line = StatusLine(
            total,
            fmt=f"[{{bar:{width}}}] {{n_fmt}}/{{total_fmt}}{{unit}}  {{info}}  {{rate_fmt}}  {{elapsed}}",
            unit=f" {label}",
            stream=stream,
            enabled=enabled,
            every_s=every_s,
        )

    def update(self, trajectory: Trajectory) -> None:
        with self._lock:
            self.done += 1
            self.counts[trajectory.status] = self.counts.get(trajectory.status, 0) + 1
            if trajectory.status == "ok" and trajectory.reward is not None:
                self.reward_sum += trajectory.reward
            self._line.show(self.done, self._info())

    def _info(self) -> str:
        ok = self.counts["ok"]
        mean = self.reward_sum / ok if ok else 0.0
        return (
            f"ok={ok} error={self.counts['error']} timeout={self.counts['timeout']} "
            f"reward={mean:.3f}"
        )

    def line(self) -> str:
        with self._lock:
            return self._line.line()

    def close(self) -> None:
        self._line.close()


def _isatty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
