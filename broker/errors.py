"""Broker errors, grouped by what the caller should do.

BrokerError
├── BrokerUnavailable   cannot reach / authenticate to NATS: fix the URL or credentials
├── ProvisioningError   a stream/consumer/bucket cannot be made to match its definition
└── ServerLaunchError   the embedded nats-server could not be started
"""

from __future__ import annotations

# JetStream API error codes we decide on (the exception *class* is ambiguous: a full
# stream raises the same class as "JetStream unavailable").
ERR_STREAM_FULL = 10077  # maximum messages/bytes exceeded with discard-new
ERR_WRONG_LAST_SEQUENCE = 10071  # Nats-Expected-Last-Subject-Sequence did not match
ERR_STREAM_NOT_FOUND = 10059
ERR_CONSUMER_NOT_FOUND = 10014


class BrokerError(Exception):
    """Root of every error raised by ``broker``."""


class BrokerUnavailable(BrokerError):
    """NATS cannot be reached, or refused our credentials."""


class ProvisioningError(BrokerError):
    """A stream, consumer or bucket could not be created or updated safely."""


class ServerLaunchError(BrokerError):
    """The nats-server process could not be started or did not become ready."""
