"""Queue-level gauges for Prometheus, read from the broker in one place.

What ``agentarium broker status`` shows (``collect_status``), as gauges: jobs waiting, in flight
(delivered, unacked), redelivered and stranded per agent, dead letters per agent, live workers,
trajectories stored and the policy version per run. They describe streams, not a process, so
exactly one process exports them (the dashboard, or any process that calls
``collect_stream_metrics``); every consumer exporting them would multiply each series by the
number of consumers.

``StreamMetrics`` is a Prometheus collector over the latest ``BrokerStatus``: ``refresh()``
reads the broker (at most once per ``min_interval_s``, however many scrapers ask), ``update()``
takes a status someone already read (a dashboard polling ``collect_status`` for its own screen
need not read twice). Agents and runs that disappear leave no stale series behind.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Iterator

from nats.js import JetStreamContext
from prometheus_client import REGISTRY, CollectorRegistry
from prometheus_client.core import GaugeMetricFamily

from .prometheus import MetricsServer
from .status import BrokerStatus, collect_status
from .topology import Topology

# (name, help, AgentStatus field): one gauge per agent.
AGENT_GAUGES = (
    ("agentarium_queue_waiting_jobs", "Jobs in the TASKS stream for the agent", "waiting"),
    (
        "agentarium_queue_pending_jobs",
        "Jobs the agent's consumer has not delivered yet",
        "pending",
    ),
    (
        "agentarium_queue_in_flight_jobs",
        "Jobs delivered to a worker and not yet acknowledged",
        "in_flight",
    ),
    (
        "agentarium_queue_redelivered_jobs",
        "In-flight jobs delivered more than once (a worker died, or an agent error is retried)",
        "redelivered",
    ),
    (
        "agentarium_queue_stranded_jobs",
        "Jobs in the stream that the consumer will no longer deliver",
        "stranded",
    ),
    ("agentarium_dead_letter_jobs", "Dead letters stored for the agent", "dead_lettered"),
    ("agentarium_workers", "Live rollout workers in the registry", "workers"),
    (
        "agentarium_workers_rollouts_per_second",
        "Rollouts per second summed over the agent's live workers",
        "rollouts_per_s",
    ),
)


class StreamMetrics:
    """Gauges over the latest ``BrokerStatus``; register it once in a registry."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        *,
        runs: tuple[str, ...] = (),
        min_interval_s: float = 5.0,
    ) -> None:
        self.js = js
        self.topology = topology
        self.runs = runs
        self.min_interval_s = min_interval_s
        self.status: BrokerStatus | None = None
        self._read_at = 0.0  # monotonic time of the last status
        self._lock = asyncio.Lock()

    def __repr__(self) -> str:
        agents = len(self.status.agents) if self.status else 0
        return f"<StreamMetrics prefix={self.topology.prefix} agents={agents}>"

    def update(self, status: BrokerStatus) -> None:
        """Show ``status`` from now on (a status read elsewhere)."""
        self.status = status
        self._read_at = time.monotonic()

    async def refresh(self) -> BrokerStatus:
        """Read the broker, unless the last status is younger than ``min_interval_s``."""
        async with self._lock:  # concurrent scrapes share one read
            if self.status is None or time.monotonic() - self._read_at >= self.min_interval_s:
                self.update(await collect_status(self.js, self.topology, runs=self.runs))
            assert self.status is not None
            return self.status

    # ---- the Collector protocol ------------------------------------------------------------

    def describe(self) -> Iterable[GaugeMetricFamily]:
        # Names only: registering must not read the broker (the default registry would call
        # collect() to learn them).
        return list(self._families().values())

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = self.status
        families = self._families()
        if status is None:
            return
        for name, _, attr in AGENT_GAUGES:
            for agent in status.agents:
                families[name].add_metric([agent.agent], float(getattr(agent, attr)))
        for run, count in status.trajectories.items():
            families["agentarium_trajectories_stored"].add_metric([run], float(count))
        for run, update in status.policy.items():
            version = update.get("version") if isinstance(update, dict) else None
            if isinstance(version, int | float):
                families["agentarium_policy_version"].add_metric([run], float(version))
        families["agentarium_tasks_stream_messages"].add_metric([], float(status.tasks_total))
        families["agentarium_tasks_stream_bytes"].add_metric([], float(status.tasks_bytes))
        families["agentarium_stream_metrics_age_seconds"].add_metric(
            [], time.monotonic() - self._read_at
        )
        yield from families.values()

    @staticmethod
    def _families() -> dict[str, GaugeMetricFamily]:
        out = {
            name: GaugeMetricFamily(name, doc, labels=["agent"]) for name, doc, _ in AGENT_GAUGES
        }
        out["agentarium_trajectories_stored"] = GaugeMetricFamily(
            "agentarium_trajectories_stored",
            "Trajectories in the TRAJECTORIES stream per run",
            labels=["run"],
        )
        out["agentarium_policy_version"] = GaugeMetricFamily(
            "agentarium_policy_version",
            "Latest policy version published per run (the policy KV)",
            labels=["run"],
        )
        out["agentarium_tasks_stream_messages"] = GaugeMetricFamily(
            "agentarium_tasks_stream_messages", "Messages in the TASKS stream"
        )
        out["agentarium_tasks_stream_bytes"] = GaugeMetricFamily(
            "agentarium_tasks_stream_bytes", "Bytes in the TASKS stream"
        )
        out["agentarium_stream_metrics_age_seconds"] = GaugeMetricFamily(
            "agentarium_stream_metrics_age_seconds",
            "Age of the broker status these gauges show",
        )
        return out


def collect_stream_metrics(
    js: JetStreamContext,
    topology: Topology,
    server: MetricsServer | None = None,
    *,
    registry: CollectorRegistry | None = None,
    runs: tuple[str, ...] = (),
    min_interval_s: float = 5.0,
) -> StreamMetrics:
    """Export the queue gauges from this process: register a ``StreamMetrics`` in ``registry``
    (default: the server's, else the default registry) and, with a ``server``, refresh it
    before each scrape. Call it in one process per prefix (the dashboard)."""
    collector = StreamMetrics(js, topology, runs=runs, min_interval_s=min_interval_s)
    target = registry or (server.registry if server is not None else REGISTRY)
    try:
        target.register(collector)
    except ValueError as exc:  # prometheus_client's DuplicateTimeseries
        raise ValueError(
            "this registry exports the queue gauges already: call collect_stream_metrics once "
            f"per process (or give each call its own registry) ({exc})"
        ) from exc
    if server is not None:
        server.on_scrape(collector.refresh)
    return collector
