"""Broker errors, grouped by what the caller should do.

BrokerError
├── BrokerUnavailable   cannot reach / authenticate to NATS: fix the URL or credentials
├── ProvisioningError   a stream/consumer/bucket cannot be made to match its definition
├── ServerLaunchError   the embedded nats-server could not be started
└── MetricsServerError  the /metrics server could not listen: pick another port
"""

from __future__ import annotations

import nats.errors
import nats.js.errors

# JetStream API error codes we decide on (the exception *class* is ambiguous: a full
# stream raises the same class as "JetStream unavailable").
ERR_STREAM_FULL = 10077  # maximum messages/bytes exceeded with discard-new
ERR_WRONG_LAST_SEQUENCE = 10071  # Nats-Expected-Last-Subject-Sequence did not match
ERR_STREAM_NOT_FOUND = 10059
ERR_CONSUMER_NOT_FOUND = 10014
# "JetStream system temporarily unavailable": a restarting server or a leader election.
ERR_JS_TEMPORARILY_UNAVAILABLE = 10008

# Failures that go away by themselves: a timeout, a restarting server, a leader election, a
# client reconnecting with its buffer full. Whoever meets one waits and retries the same call.
# Not in it: ConnectionClosedError. nats-py never reopens a closed connection (it closes on our
# own close() or after its last reconnect attempt), so retrying on one would spin forever.
TRANSIENT_NATS_ERRORS: tuple[type[Exception], ...] = (
    TimeoutError,  # asyncio's and nats.errors.TimeoutError are subclasses
    nats.errors.NoRespondersError,
    nats.js.errors.NoStreamResponseError,
    nats.errors.StaleConnectionError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
)


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same call later may succeed (see TRANSIENT_NATS_ERRORS)."""
    return isinstance(exc, TRANSIENT_NATS_ERRORS)


class BrokerError(Exception):
    """Root of every error raised by ``broker``."""


class BrokerUnavailable(BrokerError):
    """NATS cannot be reached, or refused our credentials."""


class ProvisioningError(BrokerError):
    """A stream, consumer or bucket could not be created or updated safely."""


class ServerLaunchError(BrokerError):
    """The nats-server process could not be started or did not become ready."""


class MetricsServerError(BrokerError):
    """The metrics and health server could not listen (port taken, address not local)."""
