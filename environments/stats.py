"""A worker's counters, step latencies and start rate: what its ``$SRV.STATS`` reply carries.

Latency percentiles come from the last ``LATENCY_WINDOW`` steps (a ring, sorted when asked),
the start rate from per-second buckets over the last ``RATE_WINDOW_S`` seconds: both cost O(1)
per request, so a busy worker pays nothing for being watched.
"""

from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass, field

LATENCY_WINDOW = 2048
RATE_WINDOW_S = 10


def percentile(sorted_values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of sorted values; 0 when empty."""
    if not sorted_values:
        return 0.0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


class RateCounter:
    """Events per second over the last ``window_s`` whole seconds."""

    def __init__(self, window_s: int = RATE_WINDOW_S, clock=time.monotonic) -> None:
        self.window_s = window_s
        self._clock = clock
        self._buckets: deque[list[int]] = deque()  # [second, count], oldest first

    def add(self, n: int = 1) -> None:
        second = int(self._clock())
        if self._buckets and self._buckets[-1][0] == second:
            self._buckets[-1][1] += n
        else:
            self._buckets.append([second, n])
        self._trim(second)

    def rate(self) -> float:
        now = int(self._clock())
        self._trim(now)
        return sum(count for _, count in self._buckets) / self.window_s

    def _trim(self, now: int) -> None:
        while self._buckets and self._buckets[0][0] <= now - self.window_s:
            self._buckets.popleft()


@dataclass
class WorkerCounters:
    """What happened on one worker since it started."""

    starts: int = 0  # sessions started
    start_failures: int = 0  # resets that raised (answered 400 or 500)
    rejected: int = 0  # starts answered 503
    steps: int = 0
    closed: int = 0
    expired: int = 0
    errors: int = 0  # answered 500: the environment raised
    bad_requests: int = 0  # answered 400, 404, 409 or 413
    latencies_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    start_rate: RateCounter = field(default_factory=RateCounter)

    def step_latency_ms(self) -> tuple[float, float]:
        """(p50, p99) of the recent steps, in milliseconds."""
        ordered = sorted(self.latencies_s)
        return (
            round(percentile(ordered, 50) * 1000, 3),
            round(percentile(ordered, 99) * 1000, 3),
        )
