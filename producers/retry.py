"""What to do when a publish fails: wait and retry, or give up — decided on the error code.

A full stream (err 10077) answers with the same exception class as "JetStream unavailable",
so the decision is made on ``err_code``, not on the class. Retrying is always safe: every
job carries ``Nats-Msg-Id`` = its job id, and the server drops a second copy.
"""

from __future__ import annotations

import enum

import nats.js.errors

from agentarium.broker import ERR_JS_TEMPORARILY_UNAVAILABLE, ERR_STREAM_FULL, Backoff, is_transient


class PublishOutcome(enum.Enum):
    """What a failed publish calls for."""

    FULL = "full"  # backpressure: wait for consumers to drain the stream
    UNAVAILABLE = "unavailable"  # the broker is restarting or unreachable: wait for it
    NO_STREAM = "no_stream"  # nobody answered on the subject: restarting, or not provisioned
    FATAL = "fatal"  # retrying cannot help


def classify(exc: BaseException) -> PublishOutcome:
    # Before is_transient(), which also holds this one: here it has its own answer.
    if isinstance(exc, nats.js.errors.NoStreamResponseError):
        return PublishOutcome.NO_STREAM
    if isinstance(exc, nats.js.errors.APIError):
        if exc.err_code == ERR_STREAM_FULL:
            return PublishOutcome.FULL
        if exc.err_code == ERR_JS_TEMPORARILY_UNAVAILABLE:
            return PublishOutcome.UNAVAILABLE
        if exc.err_code is None and exc.code == 503:  # a bare 503 status: no responders yet
            return PublishOutcome.UNAVAILABLE
        return PublishOutcome.FATAL
    if is_transient(exc):
        return PublishOutcome.UNAVAILABLE
    return PublishOutcome.FATAL


# How long a producer waits before publishing a job again: 0.2 s doubling to 5 s, each wait
# drawn from [ceiling/2, ceiling] so producers blocked on the same full stream do not all
# retry at once.
PUBLISH_BACKOFF = Backoff(initial_s=0.2, max_s=5.0, jitter=0.5)
