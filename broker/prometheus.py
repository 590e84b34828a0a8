"""Prometheus exposition and Kubernetes health endpoints, for any long-running process.

``MetricsServer`` is one small aiohttp server per process:

- ``GET /metrics``: a registry in Prometheus' text format (OpenMetrics when the scraper asks);
- ``GET /healthz``: liveness, 200 while the event loop answers and every liveness check holds;
- ``GET /readyz``: readiness, 200 once every readiness check holds (connected to NATS, the worker
  bound to its consumer), else 503 with the failing checks in a JSON body.

Metric definitions live with the component that counts them (``consumers/metrics.py``,
``trainer/prometheus.py``, ``inference/engine/metrics.py``); this module only serves them. Values
that are read rather than counted (queue depths, from the broker) are refreshed by hooks that
run before each scrape (``on_scrape``), so they are as fresh as the scrape and cost nothing
between scrapes. Label values are bounded sets (agent, status, run, engine URL), never a job id.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from prometheus_client import REGISTRY, CollectorRegistry, Counter, disable_created_metrics
from prometheus_client.exposition import choose_encoder

from .errors import MetricsServerError

log = structlog.get_logger("agentarium.metrics")

# Every counter and histogram would otherwise carry a second `_created` series (its creation
# time), doubling the series count for something no dashboard here reads.
disable_created_metrics()

Check = Callable[[], bool | Awaitable[bool]]
Refresh = Callable[[], Awaitable[Any]]

REFRESH_ERRORS = Counter(
    "agentarium_metrics_refresh_errors",
    "Scrapes whose refresh hook failed or timed out (the scrape then shows the last values)",
)


def render_metrics(registry: CollectorRegistry = REGISTRY, accept: str = "") -> tuple[bytes, str]:
    """The registry's exposition for a scraper's ``Accept`` header: (body, content type)."""
    encoder, content_type = choose_encoder(accept)
    return encoder(registry), content_type


def metrics_response(request: web.Request, registry: CollectorRegistry = REGISTRY) -> web.Response:
    """An aiohttp response for ``GET /metrics``: what an app with routes of its own (the local
    engine) adds to serve metrics on its own port."""
    body, content_type = render_metrics(registry, request.headers.get("Accept", ""))
    # content_type= would refuse the charset parameter: set the header whole.
    return web.Response(body=body, headers={"Content-Type": content_type})


class MetricsServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on ``host:port`` (port 0: any free port).

    ``await MetricsServer(port).start()`` returns once it listens (``url`` then carries the real
    port, also logged); ``await close()`` stops it. Checks and hooks may be added before or
    after ``start()``; each returns the server, so they chain.
    """

    def __init__(
        self,
        port: int = 0,
        *,
        host: str = "0.0.0.0",
        registry: CollectorRegistry = REGISTRY,
        refresh_timeout_s: float = 10.0,
    ) -> None:
        if not 0 <= port <= 65535:
            raise ValueError(f"metrics port must be in 0..65535 (0: any free port), got {port}")
        self.host = host
        self.port = port
        self.registry = registry
        self.refresh_timeout_s = refresh_timeout_s
        self._ready: dict[str, Check] = {}
        self._live: dict[str, Check] = {}
        self._refresh: list[Refresh] = []
        self._runner: web.AppRunner | None = None

    def __repr__(self) -> str:
        return f"<MetricsServer {self.url or f'{self.host}:{self.port} (not started)'}>"

    # ---- configuration -----------------------------------------------------------------------

    def readiness(self, name: str, check: Check) -> MetricsServer:
        """``/readyz`` answers 200 only while ``check()`` (sync or async) is true."""
        self._ready[name] = check
        return self

    def liveness(self, name: str, check: Check) -> MetricsServer:
        """``/healthz`` answers 503 while ``check()`` is false: Kubernetes restarts the pod."""
        self._live[name] = check
        return self

    def on_scrape(self, refresh: Refresh) -> MetricsServer:
        """Await ``refresh()`` before each ``/metrics`` answer (bounded by refresh_timeout_s)."""
        self._refresh.append(refresh)
        return self

    # ---- lifecycle ---------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``http://host:port`` once started (a wildcard host reads as 127.0.0.1), else ''."""
        if self._runner is None:
            return ""
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}"

    async def start(self) -> MetricsServer:
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/healthz", self._healthz)
        app.router.add_get("/readyz", self._readyz)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, self.host, self.port).start()
        except OSError as exc:
            await runner.cleanup()
            raise MetricsServerError(
                f"cannot serve metrics on {self.host}:{self.port} ({exc.strerror or exc}): pass "
                "another --metrics-port, or 0 for any free port"
            ) from exc
        self._runner = runner
        self.port = runner.addresses[0][1]
        log.info("metrics listening", url=f"{self.url}/metrics", host=self.host, port=self.port)
        return self

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def __aenter__(self) -> MetricsServer:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- handlers ----------------------------------------------------------------------------

    async def _metrics(self, request: web.Request) -> web.Response:
        for refresh in self._refresh:
            started = time.monotonic()
            try:
                await asyncio.wait_for(refresh(), self.refresh_timeout_s)
            except Exception as exc:  # noqa: BLE001 - a scrape still answers, with older values
                REFRESH_ERRORS.inc()
                log.warning(
                    "metrics refresh failed; serving the last values",
                    hook=getattr(refresh, "__qualname__", repr(refresh)),
                    error=str(exc) or type(exc).__name__,
                    seconds=round(time.monotonic() - started, 3),
                )
        return metrics_response(request, self.registry)

    async def _healthz(self, request: web.Request) -> web.Response:
        return await _answer(self._live)

    async def _readyz(self, request: web.Request) -> web.Response:
        return await _answer(self._ready)


async def _answer(checks: dict[str, Check]) -> web.Response:
    results: dict[str, str] = {}
    for name, check in checks.items():
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
            results[name] = "ok" if value else "failing"
        except Exception as exc:  # noqa: BLE001 - a raising check is a failing one
            results[name] = f"failing: {str(exc) or type(exc).__name__}"
    ok = all(r == "ok" for r in results.values())
    return web.json_response({"ok": ok, "checks": results}, status=200 if ok else 503)
