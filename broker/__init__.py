"""NATS plumbing: connection settings, topology, provisioning, the embedded server, status."""

from .errors import (
    TRANSIENT_NATS_ERRORS,
    BrokerError,
    BrokerUnavailable,
    ProvisioningError,
    ServerLaunchError,
    is_transient,
)
from .provision import ProvisionReport, provision
from .server import NatsServer, find_nats_server, free_port
from .settings import NatsSettings
from .topology import Limits, Topology

__all__ = [
    "BrokerError",
    "BrokerUnavailable",
    "Limits",
    "NatsServer",
    "NatsSettings",
    "ProvisionReport",
    "ProvisioningError",
    "ServerLaunchError",
    "TRANSIENT_NATS_ERRORS",
    "Topology",
    "find_nats_server",
    "free_port",
    "is_transient",
    "provision",
]
