"""Backoff: the one way a retry waits (capped exponential, jittered downwards).

Every loop that retries (publishing a job, an LLM request, a fleet probe, a job's next
delivery, attaching to a restarting broker) asks a ``Backoff`` for its wait instead of
doubling a delay inline. Retries count from 1: ``delay(1)`` is the wait before the first
retry. The wait is drawn from ``[ceiling * (1 - jitter), ceiling]``, so clients that failed
together do not come back together, and no wait exceeds ``max_s``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True)
class Backoff:
    """``ceiling(n) = min(max_s, initial_s * multiplier ** (n - 1))`` for retry ``n`` >= 1."""

    initial_s: float = 0.5
    max_s: float = 10.0
    multiplier: float = 2.0
    jitter: float = 0.2  # the share of the ceiling a wait may fall short of it by

    def __post_init__(self) -> None:
        if not 0 <= self.initial_s <= self.max_s:
            raise ValueError(
                f"Backoff needs 0 <= initial_s <= max_s, got {self.initial_s} and {self.max_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"Backoff.multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"Backoff.jitter must be in [0, 1], got {self.jitter}")

    def ceiling(self, retry: int) -> float:
        """The longest wait before retry number ``retry`` (1-based)."""
        exponent = max(0, retry - 1)
        if self.initial_s == 0:
            return 0.0
        # multiplier ** exponent overflows a float past ~1000 retries: stop at the cap first
        value = self.initial_s
        for _ in range(exponent):
            value *= self.multiplier
            if value >= self.max_s:
                return self.max_s
        return min(self.max_s, value)

    def delay(self, retry: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``retry`` (1-based), jittered."""
        ceiling = self.ceiling(retry)
        return ceiling * (1 - self.jitter * (rng or random).random())
