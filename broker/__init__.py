"""NATS plumbing: connection settings, topology, provisioning, the embedded server, status
(environment services' included, from the NATS service API),
the workers registry, stream tails for live views, telemetry (logging,
tracing, trace context in message headers) and the Prometheus side shared by every service
(the /metrics and health server, queue gauges)."""

from .aio import cancel_and_wait, round_trip
from .backoff import Backoff
from .env_status import (
    ENV_SERVICE_KIND,
    EnvServiceStatus,
    collect_env_status,
    format_env_status,
    gather_replies,
)
from .errors import (
    ERR_CONSUMER_NOT_FOUND,
    ERR_JS_TEMPORARILY_UNAVAILABLE,
    ERR_STREAM_FULL,
    ERR_STREAM_NOT_FOUND,
    ERR_WRONG_LAST_SEQUENCE,
    TRANSIENT_NATS_ERRORS,
    BrokerError,
    BrokerUnavailable,
    MetricsServerError,
    ProvisioningError,
    ServerLaunchError,
    is_transient,
)
from .eventloop import loop_name, new_event_loop, run_loop, watch_lag
from .foreground import run_in_foreground
from .gc_tuning import tune_gc
from .kvput import put_entry
from .kvwatch import follow_key_value
from .limits import Limits
from .patience import START_PATIENCE_S, is_unavailable, patiently
from .ports import free_port
from .prometheus import MetricsServer, metrics_response, render_metrics
from .provision import (
    ProvisionReport,
    ensure_consumer,
    ensure_provisioned,
    ensure_streams,
    provision,
)
from .publisher import JetStreamPublisher
from .registry import json_entries, live_workers, publish_worker, remove_worker
from .server import NatsServer, find_nats_server, is_loopback
from .settings import NatsSettings
from .status import BrokerStatus, collect_status, count_messages, format_status
from .stream_metrics import StreamMetrics, collect_stream_metrics
from .sweep import SweepReport, format_sweep, sweep_stranded, trajectory_stored
from .tail import Tail, read_tail
from .telemetry import (
    OPENINFERENCE_SPAN_KIND,
    CurrentSpan,
    continue_trace,
    current_traceparent,
    extract_context,
    inject_headers,
    propagating_trace_config,
    setup_logging,
    setup_tracing,
    shutdown_tracing,
    span_id_hex,
    trace_id_hex,
)
from .topology import Topology

__all__ = [
    "Backoff",
    "follow_key_value",
    "put_entry",
    "ENV_SERVICE_KIND",
    "EnvServiceStatus",
    "collect_env_status",
    "format_env_status",
    "gather_replies",
    "ERR_CONSUMER_NOT_FOUND",
    "ERR_JS_TEMPORARILY_UNAVAILABLE",
    "ERR_STREAM_FULL",
    "ERR_STREAM_NOT_FOUND",
    "ERR_WRONG_LAST_SEQUENCE",
    "BrokerError",
    "BrokerStatus",
    "BrokerUnavailable",
    "CurrentSpan",
    "JetStreamPublisher",
    "Limits",
    "MetricsServer",
    "MetricsServerError",
    "NatsServer",
    "NatsSettings",
    "OPENINFERENCE_SPAN_KIND",
    "ProvisionReport",
    "ProvisioningError",
    "START_PATIENCE_S",
    "ServerLaunchError",
    "StreamMetrics",
    "SweepReport",
    "Tail",
    "TRANSIENT_NATS_ERRORS",
    "Topology",
    "cancel_and_wait",
    "collect_status",
    "sweep_stranded",
    "trajectory_stored",
    "collect_stream_metrics",
    "count_messages",
    "ensure_consumer",
    "ensure_provisioned",
    "ensure_streams",
    "continue_trace",
    "current_traceparent",
    "extract_context",
    "find_nats_server",
    "format_status",
    "format_sweep",
    "free_port",
    "is_loopback",
    "inject_headers",
    "is_transient",
    "is_unavailable",
    "json_entries",
    "live_workers",
    "loop_name",
    "metrics_response",
    "new_event_loop",
    "patiently",
    "propagating_trace_config",
    "provision",
    "publish_worker",
    "read_tail",
    "remove_worker",
    "render_metrics",
    "round_trip",
    "run_in_foreground",
    "run_loop",
    "setup_logging",
    "setup_tracing",
    "shutdown_tracing",
    "span_id_hex",
    "trace_id_hex",
    "tune_gc",
    "watch_lag",
]
