"""Retry policy for agent failures: data, not try/except scattered through the loop.

A job is run at most ``attempts`` times. JetStream's ``max_deliver`` is set to
``attempts + 1`` so that a job whose last run crashed the worker (or missed its ack)
is delivered once more: that delivery is never run, only dead-lettered and terminated,
because a work-queue stream would otherwise keep a max-delivered job forever.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum


class Decision(Enum):
    RUN = "run"  # run the rollout
    DEAD_LETTER = "dead_letter"  # deliveries exhausted: dead-letter without running


@dataclass(frozen=True, kw_only=True)
class RetryPolicy:
    attempts: int = 3
    base_delay_s: float = 1.0
    max_delay_s: float = 60.0
    jitter: float = 0.2

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be >= 1")
        if self.base_delay_s < 0 or self.max_delay_s < self.base_delay_s:
            raise ValueError("need 0 <= base_delay_s <= max_delay_s")

    @property
    def max_deliver(self) -> int:
        return self.attempts + 1

    def on_delivery(self, num_delivered: int) -> Decision:
        return Decision.RUN if num_delivered <= self.attempts else Decision.DEAD_LETTER

    def is_last_attempt(self, num_delivered: int) -> bool:
        return num_delivered >= self.attempts

    def delay_s(self, num_delivered: int) -> float:
        """Capped exponential backoff before the next delivery, with jitter."""
        delay = min(self.max_delay_s, self.base_delay_s * 2 ** max(0, num_delivered - 1))
        return delay * (1 + random.uniform(-self.jitter, self.jitter))
