"""The weight syncer's Prometheus metrics, on the default registry that ``agentarium sync
--metrics-port`` serves (broker.MetricsServer). Labels: the run, an engine URL, a result."""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import Counter, Gauge, Histogram

# a reload's and a fetch's durations span the trainer's step buckets' range
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)

SYNC_SEEN = Gauge(
    "agentarium_sync_published_version", "Newest version the syncer has seen published", ["run"]
)
SYNC_ENGINE_VERSION = Gauge(
    "agentarium_sync_engine_weight_version",
    "Weight version each engine reported or was brought to in the last sync round",
    ["run", "engine"],
)
SYNC_FETCH_SECONDS = Histogram(
    "agentarium_sync_fetch_duration_seconds",
    "Fetching and verifying one version's weights",
    ["run"],
    buckets=BUCKETS,
)
SYNC_RELOAD_SECONDS = Histogram(
    "agentarium_sync_reload_duration_seconds",
    "pause -> update_weights_from_disk -> continue on one engine",
    ["run", "engine"],
    buckets=BUCKETS,
)
SYNC_MISMATCH = Counter(
    "agentarium_sync_mismatch",
    "Updates after which an engine did not serve what was published (its weight_version or "
    "a read-back of its parameters differed); the engine is out of the run's fleet until it does",
    ["run", "engine"],
)
SYNC_RELOADS = Counter(
    "agentarium_sync_reloads",
    "Engine reloads, by result (updated, failed)",
    ["run", "engine", "result"],
)


def record_sync_round(
    run: str, engines: Sequence[tuple[str, str, float, int | None]], fetch_s: float | None
) -> None:
    """A sync round: per engine (url, status, reload seconds, weight version now or None),
    and the fetch time when weights were fetched."""
    if fetch_s is not None:
        SYNC_FETCH_SECONDS.labels(run).observe(fetch_s)
    for url, status, seconds, version in engines:
        if status in ("updated", "failed", "mismatch"):
            SYNC_RELOADS.labels(run, url, "failed" if status == "mismatch" else status).inc()
        if status == "mismatch":
            SYNC_MISMATCH.labels(run, url).inc()
        if seconds > 0:  # 0: no reload was tried (the weights were unavailable)
            SYNC_RELOAD_SECONDS.labels(run, url).observe(seconds)
        if version is not None:
            SYNC_ENGINE_VERSION.labels(run, url).set(version)
