"""What to do when a publish fails: wait and retry, or give up — decided on the error code.

A full stream (err 10077) answers with the same exception class as "JetStream unavailable",
so the decision is made on ``err_code``, not on the class. Retrying is always safe: every
job carries ``Nats-Msg-Id`` = its job id, and the server drops a second copy.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

import nats.js.errors

from broker import ERR_JS_TEMPORARILY_UNAVAILABLE, ERR_STREAM_FULL, is_transient


class Outcome(enum.Enum):
    FULL = "full"  # backpressure: wait for consumers to drain the stream
    UNAVAILABLE = "unavailable"  # the broker is restarting or unreachable: wait for it
    NO_STREAM = "no_stream"  # nobody answered on the subject: restarting, or not provisioned
    FATAL = "fatal"  # retrying cannot help


def classify(exc: BaseException) -> Outcome:
    # Before is_transient(), which also holds this one: here it has its own answer.
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return Outcome.NO_STREAM
    if isinstance(exc, nats.js.errors.APIError):
        if exc.err_code == ERR_STREAM_FULL:
            return Outcome.FULL
        if exc.err_code == ERR_JS_TEMPORARILY_UNAVAILABLE:
            return Outcome.UNAVAILABLE
        if exc.err_code is None and exc.code == 503:  # a bare 503 status: no responders yet
            return Outcome.UNAVAILABLE
        return Outcome.FATAL
    if is_transient(exc):
        return Outcome.UNAVAILABLE
    return Outcome.FATAL


@dataclass(frozen=True, kw_only=True)
class PublishRetry:
    """How long a producer waits before publishing a job again: capped exponential backoff
    with jitter, ``initial_s * 2**(attempt-1)`` at most ``max_s``.

    The wait is drawn from [delay/2, delay] so producers blocked on the same full stream do
    not all retry at once.
    """

    initial_s: float = 0.2
    max_s: float = 5.0
    multiplier: float = 2.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError("PublishRetry needs 0 < initial_s <= max_s")
        if self.multiplier < 1:
            raise ValueError("PublishRetry.multiplier must be >= 1")

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number ``attempt`` (1-based)."""
        exp = min(self.max_s, self.initial_s * self.multiplier ** max(0, attempt - 1))
        return exp / 2 + (rng or random).random() * exp / 2
