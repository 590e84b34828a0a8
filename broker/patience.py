"""Start-up requests that wait out a restarting broker or a leader election.

A service's first JetStream requests (does the TASKS stream exist? create what is missing)
meet the same elections its publishes do: a SIGKILLed stream leader leaves the stream
unanswered for a few seconds, and a request in that gap times out or is answered "JetStream
system temporarily unavailable". Publishes are retried by policy (``producers.retry``);
these requests are retried here, with backoff, for at most ``patience_s``, then reported in
words. Only failures that go away by themselves are retried: a missing stream, a refused
permission or a bad definition is raised at once.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import nats.js.errors
import structlog

from .errors import ERR_JS_TEMPORARILY_UNAVAILABLE, BrokerUnavailable, is_transient

log = structlog.get_logger("agentarium.broker")

T = TypeVar("T")

# Long enough for a restarted node to come back or a cluster to elect new leaders (seconds
# measured in tests/test_cluster.py), short enough that a broker that is really down is
# reported within a minute rather than waited on forever.
START_PATIENCE_S = 60.0


def is_unavailable(exc: BaseException) -> bool:
    """Whether the broker is away for now (restarting, electing a leader), not refusing."""
    if is_transient(exc):
        return True
    if isinstance(exc, nats.js.errors.APIError):
        if exc.err_code == ERR_JS_TEMPORARILY_UNAVAILABLE:
            return True
        return exc.err_code is None and exc.code == 503  # a bare 503: no responders yet
    return False


async def patiently(
    call: Callable[[], Awaitable[T]],
    *,
    patience_s: float,
    what: str,
    initial_s: float = 0.2,
    max_s: float = 2.0,
) -> T:
    """``await call()``, again after each failure ``is_unavailable`` allows, until
    ``patience_s`` seconds have passed (0: once; the last try may end up to one request
    timeout later). ``call`` must be safe to repeat (idempotent)."""
    deadline = time.monotonic() + patience_s
    delay = initial_s
    warned = False
    while True:
        try:
            return await call()
        except Exception as exc:
            if not is_unavailable(exc):
                raise
            detail = str(exc) or type(exc).__name__
            if patience_s <= 0:
                raise
            if time.monotonic() + delay > deadline:
                raise BrokerUnavailable(
                    f"{what}: NATS did not answer for {patience_s:.0f}s ({detail}): is the "
                    "server up, and on a cluster a majority of its nodes? `agentarium broker "
                    "status` shows what answers"
                ) from exc
            if not warned:  # once per wait, not once per retry
                log.warning("broker unavailable; waiting for it", during=what, error=detail)
                warned = True
            await asyncio.sleep(delay)
            delay = min(max_s, delay * 2)
