"""What the long-running commands share (consumer, env serve|bridge, trainer, sync, dashboard):
the metrics server and its probes, the connection and metrics flags that are no config keys,
and the stop signals that drain instead of killing."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import AsyncIterator, Callable, Mapping

from nats.aio.client import Client

from agentarium.broker import MetricsServer

from ..config import ConfigKeys
from .common import add_nats_flags, connection_flags, port_number


def add_service_flags(parser: argparse.ArgumentParser) -> None:
    """The metrics server's flags, then the NATS connection's."""
    _add_metrics_flags(parser)
    add_nats_flags(parser)


def _add_metrics_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "metrics and probes",
        "Prometheus /metrics plus /healthz (liveness) and /readyz (readiness) for Kubernetes.",
    )
    group.add_argument(
        "--metrics-port",
        type=port_number,
        default=None,
        metavar="PORT",
        help="serve /metrics, /healthz and /readyz on this port; 0 picks a free one (logged as "
        "'metrics listening'); default: off",
    )
    group.add_argument(
        "--metrics-host",
        default="0.0.0.0",
        metavar="HOST",
        help="bind address of the metrics server (default %(default)s)",
    )


def service_keys(
    command: str, *classes: type, keyless: Mapping[str, str] | None = None
) -> ConfigKeys:
    """The config keys of a service's settings ``classes``; its connection and metrics flags
    are flags only (``keyless``: more of those, each with its reason)."""
    reason = (
        "where this process serves /metrics and probes belongs to its deployment (the "
        "manifest's ports), not to the run's settings"
    )
    parser = argparse.ArgumentParser(add_help=False)
    _add_metrics_flags(parser)
    metrics = {action.dest: reason for action in parser._actions}
    return ConfigKeys.of(
        command, *classes, keyless={**connection_flags(), **metrics, **(keyless or {})}
    )


def metrics_server(args: argparse.Namespace) -> MetricsServer | None:
    """The server ``--metrics-port`` asks for, not started yet; None when the flag is absent."""
    if args.metrics_port is None:
        return None
    return MetricsServer(args.metrics_port, host=args.metrics_host)


@contextlib.asynccontextmanager
async def probes(
    args: argparse.Namespace, nc: Client, kind: str, ready: Callable[[], bool]
) -> AsyncIterator[None]:
    """The metrics server ``--metrics-port`` asks for, serving while the block runs: ready
    while NATS is connected and ``ready()`` (named ``kind``) holds."""
    metrics = metrics_server(args)
    if metrics is None:
        yield
        return
    try:
        metrics.readiness("nats", lambda: nc.is_connected)
        metrics.readiness(kind, ready)
        await metrics.start()
        yield
    finally:
        await metrics.close()


def install_stop_handlers(stop: Callable[[], None]) -> None:
    """SIGTERM and SIGINT call ``stop`` (drain) instead of killing the loop."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop)
