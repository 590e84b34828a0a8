"""The dashboard's HTTP side: the page, its two files, ``/api/state``, and the refresh loop.

One loop reads the broker every ``refresh_s``, or less often when a read takes long (a round
never starts sooner than three times what the last read took, so a large broker is not polled
flat out); any number of open pages poll ``/api/state``, which serves the latest snapshot
without touching NATS.

The page is plain HTML, CSS and JavaScript shipped with the package (no build step, no CDN):
``static/``. Every response forbids scripts and connections to anything but this server
(Content-Security-Policy), and, whatever the bind, requests naming a host other than localhost,
the bind address or an ``--allowed-host`` are refused, so a web page elsewhere cannot read
dead-letter payloads through DNS rebinding.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
import time
from pathlib import Path

import nats.errors
import structlog
from aiohttp import web

from agentarium.broker import (
    MetricsServer,
    NatsSettings,
    Topology,
    collect_stream_metrics,
)

from .config import DashboardConfig
from .view import LiveView

log = structlog.get_logger("agentarium.dashboard")

STATIC = Path(__file__).parent / "static"
FILES = {  # what the page may load: nothing else is served
    "/": ("index.html", "text/html"),
    "/dashboard.js": ("dashboard.js", "text/javascript"),
    "/dashboard.css": ("dashboard.css", "text/css"),
}
SECURITY_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",  # a trace link must not leak the dashboard's address
    "Cache-Control": "no-store",
}
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::"})  # every interface: no one name to answer to


def _host_name(header: str) -> str:
    """``Host`` without its port, lower case, no trailing dot: ``[::1]:8266`` -> ``::1``,
    ``LocalHost.:8266`` -> ``localhost``."""
    if header.startswith("["):
        name = header[1 : header.find("]")]
    else:
        name = header.rsplit(":", 1)[0] if header.count(":") == 1 else header
    return name.lower().rstrip(".")


def allowed_host_names(config: DashboardConfig) -> frozenset[str]:
    """The names a request's ``Host`` may carry: the local ones, the bind address (unless it
    is a wildcard such as 0.0.0.0) and every ``--allowed-host``."""

    def name(host: str) -> str:  # an address as a Host header writes it, then its name
        bare = host.strip("[]")
        return _host_name(f"[{bare}]" if ":" in bare else bare)

    extra = {name(n) for n in config.allowed_hosts}
    return LOCAL_NAMES | extra | ({name(config.host)} - WILDCARD_BINDS)


class DashboardServer:
    """``await start()`` serves the page and refreshes ``view``; ``url`` once started."""

    def __init__(self, view: LiveView, config: DashboardConfig) -> None:
        self.view = view
        self.config = config
        self.url = ""
        self._runner: web.AppRunner | None = None
        self._loop: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._allowed = allowed_host_names(config)

    def app(self) -> web.Application:
        app = web.Application(middlewares=[self._guard])
        for path in FILES:
            app.router.add_get(path, self._file)
        app.router.add_get("/api/state", self._state)
        return app

    async def start(self) -> str:
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        try:
            await web.TCPSite(self._runner, self.config.host, self.config.port).start()
        except OSError:
            await self.close()
            raise
        host, port = self._runner.addresses[0][:2]
        host = f"[{host}]" if ":" in host else host
        self.url = f"http://{host}:{port}/"
        self._loop = asyncio.create_task(self.refresh_forever(), name="dashboard-refresh")
        return self.url

    async def close(self) -> None:
        if self._loop is not None:
            # The flag as well as the cancel: nats-py's waits may swallow a cancellation
            # (asyncio.wait_for before Python 3.12), and the loop must end all the same.
            self._stopping.set()
            self._loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop
            self._loop = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def __aenter__(self) -> DashboardServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def refresh_forever(self) -> None:
        failing = False
        while not self._stopping.is_set():
            started = time.monotonic()
            try:
                await self.view.refresh()
                if failing:
                    log.info("dashboard reads the broker again")
                failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the page shows the error; the next round tries again
                detail = str(exc) or type(exc).__name__
                self.view.failed(
                    f"cannot read the broker ({detail}): is nats-server up, and --nats-url "
                    "right? Showing the last numbers read"
                )
                if not failing:
                    log.warning("dashboard refresh failed; retrying", error=detail)
                failing = True
            took = time.monotonic() - started
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._stopping.wait(), max(self.config.refresh_s - took, 2 * took)
                )

    # ---- handlers -------------------------------------------------------------------------
    @web.middleware
    async def _guard(self, request: web.Request, handler) -> web.StreamResponse:
        # Every bind: a page on another site whose name rebinds to this address sends its own
        # name as Host, and is refused before anything is read.
        host = request.headers.get("Host", "")
        if _host_name(host) not in self._allowed:
            names = ", ".join(sorted(f"[{n}]" if ":" in n else n for n in self._allowed))
            return web.Response(
                status=421,
                text=f"this dashboard answers only to {names}: start it with "
                "--allowed-host NAME to serve the name you reach it by\n",
                headers=SECURITY_HEADERS,
            )
        response = await handler(request)
        response.headers.update(SECURITY_HEADERS)
        return response

    async def _file(self, request: web.Request) -> web.StreamResponse:
        name, content_type = FILES[request.path]
        return web.Response(
            body=(STATIC / name).read_bytes(), content_type=content_type, charset="utf-8"
        )

    async def _state(self, request: web.Request) -> web.Response:
        return web.json_response(self.view.snapshot())


async def run_dashboard(
    config: DashboardConfig, settings: NatsSettings, *, metrics: MetricsServer | None = None
) -> int:
    """Serve the dashboard until SIGTERM or SIGINT; 0 on a clean stop. ``metrics`` (not yet
    started) also serves the queue gauges of ``broker status`` for Prometheus: the one process
    that exports them, from the status the page already reads."""
    log.info("dashboard config", **config.describe(), nats=settings.redacted())
    nc = await settings.connect(name="agentarium-dashboard")
    try:
        view = LiveView(nc.jetstream(), Topology(settings.prefix), config)
        if metrics is not None:
            view.stream_metrics = collect_stream_metrics(
                view.js, view.topology, registry=metrics.registry, runs=config.runs
            )
            metrics.on_scrape(view.stream_metrics.refresh)  # fresh even with no page open
            metrics.readiness("nats", lambda: nc.is_connected)
            await metrics.start()
        server = DashboardServer(view, config)
        try:
            await server.start()
        except OSError as exc:
            print(
                f"error: cannot listen on {config.host}:{config.port} ({exc.strerror or exc}): "
                "pass another --port (or stop what uses it)",
                file=sys.stderr,
            )
            return 2
        try:
            print(f"dashboard at {server.url} (Ctrl-C to stop)", flush=True)
            stop = asyncio.Event()
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, stop.set)
            await stop.wait()
        finally:
            await server.close()
            if metrics is not None:
                await metrics.close()
    finally:
        # stopping while the broker is gone must not end in a traceback
        with contextlib.suppress(OSError, nats.errors.Error):
            await nc.close()
    return 0
