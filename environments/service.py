"""The worker's face in the NATS service API: ``$SRV.PING``, ``$SRV.INFO``, ``$SRV.STATS``.

nats-py's ``nats.micro.Service`` answers the three verbs. Its endpoints, though, are queue
subscriptions it owns and handles one message at a time, while a worker must drop its start
subscription when full (and take it back when a slot frees) and handle session requests
concurrently. So the worker subscribes itself, and this subclass reports those two
subscriptions as the service's endpoints (``start`` and ``sessions``) in INFO and STATS, with
the worker's own figures (``schemas.EnvWorkerStats``) as the ``start`` endpoint's custom data.
The service's instance id is the worker id, so ``$SRV.STATS.<service>.<worker>`` reaches one
worker.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nats.aio.client import Client
from nats.micro.service import (
    EndpointInfo,
    EndpointStats,
    Service,
    ServiceConfig,
    ServiceInfo,
    ServiceStats,
)

from agentarium.broker import ENV_SERVICE_KIND, Topology

from .base import Environment
from .config import EnvWorkerConfig, agentarium_version

# Service metadata every environment worker carries, so a reader of $SRV.* (broker status,
# env status) tells them from other services on the same server, and from other prefixes.
KIND = ENV_SERVICE_KIND


@dataclass
class EndpointCounters:
    """What the NATS service API counts per endpoint."""

    requests: int = 0
    errors: int = 0
    processing_ns: int = 0
    last_error: str = ""

    def record(self, started_ns: int, error: str = "") -> None:
        self.requests += 1
        self.processing_ns += time.perf_counter_ns() - started_ns
        if error:
            self.errors += 1
            self.last_error = error


@dataclass(frozen=True)
class Endpoint:
    name: str
    subject: str
    queue_group: str  # "" for a plain subscription
    counters: EndpointCounters


class EnvService(Service):
    """A micro service whose endpoints are subscriptions managed by someone else."""

    def __init__(
        self,
        client: Client,
        *,
        name: str,
        worker_id: str,
        version: str,
        description: str,
        metadata: dict[str, str],
        endpoints: list[Endpoint],
        custom_data: Callable[[], dict[str, Any]],
    ) -> None:
        super().__init__(
            client,
            ServiceConfig(name=name, version=version, description=description, metadata=metadata),
        )
        # nats-py draws a random instance id; ours is the worker id, already unique and
        # a valid subject token, so one worker's stats are one request away.
        self._id = worker_id
        self._managed = endpoints
        self._custom_data = custom_data

    @classmethod
    def for_worker(
        cls,
        client: Client,
        topology: Topology,
        config: EnvWorkerConfig,
        env_cls: type[Environment],
        *,
        endpoints: list[Endpoint],
        custom_data: Callable[[], dict[str, Any]],
    ) -> EnvService:
        """The service of one worker serving ``env_cls``: named after its environment, its
        metadata telling env workers (``KIND``) and their prefix apart from other services."""
        return cls(
            client,
            name=topology.env_service(config.name),
            worker_id=config.worker_id,
            version=agentarium_version(),
            description=f"agentarium environment {config.name} ({env_cls.__qualname__})",
            metadata={
                "kind": KIND,
                "prefix": topology.prefix,
                "env": config.name,
                "worker": config.worker_id,
                "class": class_path(env_cls),
            },
            endpoints=endpoints,
            custom_data=custom_data,
        )

    def stats(self) -> ServiceStats:
        stats = []
        for endpoint in self._managed:
            c = endpoint.counters
            stats.append(
                EndpointStats(
                    name=endpoint.name,
                    subject=endpoint.subject,
                    queue_group=endpoint.queue_group,
                    num_requests=c.requests,
                    num_errors=c.errors,
                    last_error=c.last_error or None,
                    processing_time=c.processing_ns,
                    average_processing_time=c.processing_ns // c.requests if c.requests else 0,
                    data=self._custom_data() if endpoint.name == "start" else None,
                )
            )
        return ServiceStats(
            id=self._id,
            name=self._name,
            version=self._version,
            metadata=self._metadata,
            endpoints=stats,
            started=self._started,
        )

    def info(self) -> ServiceInfo:
        return ServiceInfo(
            id=self._id,
            name=self._name,
            version=self._version,
            description=self._description,
            metadata=self._metadata,
            endpoints=[
                EndpointInfo(name=e.name, subject=e.subject, queue_group=e.queue_group)
                for e in self._managed
            ],
        )


def class_path(cls: type) -> str:
    """``module:QualName``, as ``agentarium env serve`` takes a class."""
    return f"{cls.__module__}:{cls.__qualname__}"
