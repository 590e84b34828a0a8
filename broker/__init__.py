"""NATS plumbing: connection settings, topology, provisioning, the embedded server, status,
the workers registry, engine weight versions, stream tails for live views and telemetry
(logging, tracing, trace context in message headers)."""

from .engines import engine_key, engine_versions, record_engine
from .errors import (
    ERR_CONSUMER_NOT_FOUND,
    ERR_STREAM_FULL,
    ERR_STREAM_NOT_FOUND,
    ERR_WRONG_LAST_SEQUENCE,
    TRANSIENT_NATS_ERRORS,
    BrokerError,
    BrokerUnavailable,
    ProvisioningError,
    ServerLaunchError,
    is_transient,
)
from .provision import (
    ProvisionReport,
    ensure_consumer,
    ensure_provisioned,
    ensure_streams,
    provision,
)
from .registry import live_workers, publish_worker, remove_worker
from .server import NatsServer, find_nats_server, free_port
from .settings import NatsSettings
from .status import BrokerStatus, collect_status, count_messages, format_status
from .tail import Tail, read_tail
from .telemetry import (
    extract_context,
    inject_headers,
    setup_logging,
    setup_tracing,
    shutdown_tracing,
    trace_id_hex,
)
from .topology import Limits, Topology

__all__ = [
    "ERR_CONSUMER_NOT_FOUND",
    "ERR_STREAM_FULL",
    "ERR_STREAM_NOT_FOUND",
    "ERR_WRONG_LAST_SEQUENCE",
    "BrokerError",
    "BrokerStatus",
    "BrokerUnavailable",
    "Limits",
    "NatsServer",
    "NatsSettings",
    "ProvisionReport",
    "ProvisioningError",
    "ServerLaunchError",
    "Tail",
    "TRANSIENT_NATS_ERRORS",
    "Topology",
    "collect_status",
    "count_messages",
    "engine_key",
    "engine_versions",
    "ensure_consumer",
    "ensure_provisioned",
    "ensure_streams",
    "extract_context",
    "find_nats_server",
    "format_status",
    "free_port",
    "inject_headers",
    "is_transient",
    "live_workers",
    "provision",
    "publish_worker",
    "read_tail",
    "record_engine",
    "remove_worker",
    "setup_logging",
    "setup_tracing",
    "shutdown_tracing",
    "trace_id_hex",
]
