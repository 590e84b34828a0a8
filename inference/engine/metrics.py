"""The local engine's Prometheus metrics, served on its own port at ``GET /metrics``.

SGLang serves ``/metrics`` on its API port too (with ``--enable-metrics``, under ``sglang:``
names); the local engine does the same under ``agentarium_engine_`` names. Each engine app has
a registry of its own, so an engine started inside another process (tests, the demo) never
mixes its series with that process's.

Requests, prompt tokens (those from the prefix cache apart) and request latency are counted as
``/generate`` answers; generated tokens, forward steps, running and waiting sequences, the
pause flag, the prefix cache's size and the weight version are read from the scheduler at each
scrape.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from agentarium.schemas import WeightIdentity

from .engine import LocalEngine

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class EngineMetrics:
    """One engine's registry: counters fed by ``observe(response, seconds)``, and the
    scheduler's state read at scrape time."""

    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "agentarium_engine_requests",
            "Generate requests answered, by finish reason (stop, length, abort)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "agentarium_engine_prompt_tokens",
            "Prompt tokens of answered requests",
            registry=self.registry,
        )
        self.cached_tokens = Counter(
            "agentarium_engine_cached_prompt_tokens",
            "Prompt tokens of answered requests whose KV came from the prefix cache",
            registry=self.registry,
        )
        self.latency = Histogram(
            "agentarium_engine_request_duration_seconds",
            "Time from a generate request's arrival to its answer (queueing included)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(_SchedulerCollector(engine))

    def observe(self, response: Any, seconds: float) -> None:
        """Count one ``/generate`` answer (a batch answers a list, one entry per prompt)."""
        for item in response if isinstance(response, list) else [response]:
            meta = item.get("meta_info", {}) if isinstance(item, dict) else {}
            finish = meta.get("finish_reason") or {}
            reason = finish.get("type", "unknown") if isinstance(finish, dict) else str(finish)
            self.requests.labels(reason).inc()
            self.prompt_tokens.inc(int(meta.get("prompt_tokens", 0) or 0))
            self.cached_tokens.inc(int(meta.get("cached_tokens", 0) or 0))
        self.latency.observe(seconds)


class _SchedulerCollector:
    def __init__(self, engine: LocalEngine) -> None:
        self.engine = engine

    def describe(self) -> list:
        return list(self._families(None))

    def collect(self) -> Iterator:
        yield from self._families(self.engine)

    @staticmethod
    def _families(engine: LocalEngine | None) -> Iterator:
        generated = CounterMetricFamily(
            "agentarium_engine_generated_tokens", "Tokens generated since the engine started"
        )
        steps = CounterMetricFamily(
            "agentarium_engine_forward_steps", "Decode steps over the running batch"
        )
        running = GaugeMetricFamily(
            "agentarium_engine_running_sequences", "Sequences in the running batch"
        )
        waiting = GaugeMetricFamily(
            "agentarium_engine_waiting_sequences", "Requests waiting to join the batch"
        )
        paused = GaugeMetricFamily(
            "agentarium_engine_paused", "1 while generation is paused (a weight reload)"
        )
        cache = GaugeMetricFamily(
            "agentarium_engine_prefix_cache_tokens",
            "Tokens whose KV the prefix cache holds (at most --prefix-cache-tokens)",
        )
        version = GaugeMetricFamily(
            "agentarium_engine_weight_version",
            "Version number of the weights the engine serves (its run and checksum are in the "
            "run label; 'default', the base weights, is 0; absent for a label no trainer wrote)",
            labels=["run"],
        )
        if engine is not None:
            s = engine.scheduler
            generated.add_metric([], s.tokens_generated)
            steps.add_metric([], s.steps)
            running.add_metric([], s.num_running)
            waiting.add_metric([], s.num_waiting)
            paused.add_metric([], 1.0 if s.paused else 0.0)
            cache.add_metric([], s.prefix_cache.tokens)
            identity = WeightIdentity.parse(s.weight_version)
            if identity is not None:  # a label set by hand: no sample rather than a lie
                version.add_metric([identity.run or ""], identity.version)
        yield from (generated, steps, running, waiting, paused, cache, version)
