"""The local engine's HTTP face: SGLang's native routes, on aiohttp, plus ``GET /metrics``
(Prometheus, see metrics.py) and ``GET /weights_checksum`` (ours: a sha256 of the served
weights, to compare them with the trainer's).

Every POST is a SERVER span continuing the caller's W3C ``traceparent``, with the request's
queue wait, prefill and decode (and the weight updates it waited through) as children
(tracing.py).

`POST /generate` with `"stream": true` answers `text/event-stream`: one `data: <chunk>` event
per engine step that added tokens (SGLang's `--incremental-streaming-output` chunks, stream.py),
then `data: [DONE]`. A client that disconnects mid-stream frees its row within a step.

Bad requests answer 400 with `{"error": {"message": ...}}`, as SGLang's /generate does (a
streamed one too: it is checked before the stream opens); a failed weight update or
weight-group call answers 400 with `{"success": false, "message": ...}`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web

from agentarium.broker import metrics_response

from .config import EngineSettings
from .engine import LocalEngine
from .errors import InvalidRequest
from .metrics import EngineMetrics
from .tracing import traced

log = structlog.get_logger("agentarium.engine")

ENGINE_KEY = web.AppKey("engine", LocalEngine)
METRICS_KEY = web.AppKey("metrics", EngineMetrics)

_FLUSH_TEXT = (
    "Cache flushed.\nPlease check backend logs for more details. "
    "(When there are running or waiting requests, the operation will not be performed.)\n"
)


def _error(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


async def _body(request: web.Request, *, required: bool = True) -> dict[str, Any]:
    raw = await request.read()
    if not raw.strip():
        if required:
            raise InvalidRequest("the request body is empty: send a JSON object")
        return {}
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"the request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:
        raise InvalidRequest("the request body is not valid JSON: nested too deeply") from exc
    if not isinstance(data, dict):
        raise InvalidRequest("the request body must be a JSON object")
    return data


@web.middleware
async def _invalid_to_400(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except InvalidRequest as exc:
        return _error(str(exc))


async def _generate(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE_KEY]
    started = time.monotonic()
    body = await _body(request)
    if body.get("stream"):
        return await _generate_stream(request, body, started)
    out = await engine.generate(body)
    request.app[METRICS_KEY].observe(out, time.monotonic() - started)
    return web.json_response(out)


async def _generate_stream(
    request: web.Request, body: dict[str, Any], started: float
) -> web.StreamResponse:
    """SGLang's stream: a ``data: <chunk>`` event per chunk, then ``data: [DONE]``. A client
    that goes away (a write fails, or its transport is closing) closes the chunk iterator,
    which frees the request's row at the next step."""
    chunks = request.app[ENGINE_KEY].generate_stream(body)  # a bad body raises: a 400, no stream
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    rid = None
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                rid = chunk["meta_info"]["id"]
                if chunk["meta_info"]["finish_reason"] is not None:
                    request.app[METRICS_KEY].observe(chunk, time.monotonic() - started)
                await _send(request, response, b"data: " + json.dumps(chunk).encode() + b"\n\n")
            await _send(request, response, b"data: [DONE]\n\n")
        except ConnectionResetError:  # aiohttp's ClientConnectionResetError is one
            log.info("stream client went away", rid=rid)
    return response


async def _send(request: web.Request, response: web.StreamResponse, data: bytes) -> None:
    # a write into a transport that is closing may still succeed (buffered): ask it first
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client closed the connection")
    await response.write(data)


async def _metrics(request: web.Request) -> web.Response:
    return metrics_response(request, request.app[METRICS_KEY].registry)


async def _health(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def _health_generate(request: web.Request) -> web.Response:
    healthy = await request.app[ENGINE_KEY].health_generate()
    return web.Response(status=200 if healthy else 503)


async def _model_info(request: web.Request) -> web.Response:
    return web.json_response(request.app[ENGINE_KEY].model_info())


async def _update_weights_from_disk(request: web.Request) -> web.Response:
    out = await request.app[ENGINE_KEY].update_weights_from_disk(await _body(request))
    return web.json_response(out, status=200 if out["success"] else 400)


async def _init_weights_update_group(request: web.Request) -> web.Response:
    out = await request.app[ENGINE_KEY].init_weights_update_group(await _body(request))
    return web.json_response(out, status=200 if out["success"] else 400)


async def _update_weights_from_distributed(request: web.Request) -> web.Response:
    out = await request.app[ENGINE_KEY].update_weights_from_distributed(await _body(request))
    return web.json_response(out, status=200 if out["success"] else 400)


async def _destroy_weights_update_group(request: web.Request) -> web.Response:
    body = await _body(request, required=False)
    out = await request.app[ENGINE_KEY].destroy_weights_update_group(body)
    return web.json_response(out, status=200 if out["success"] else 400)


async def _weights_checksum(request: web.Request) -> web.Response:
    return web.json_response(await request.app[ENGINE_KEY].weights_checksum())


async def _load_lora_adapter(request: web.Request) -> web.Response:
    out = await request.app[ENGINE_KEY].load_lora_adapter(await _body(request))
    return web.json_response(out, status=200 if out["success"] else 400)


async def _unload_lora_adapter(request: web.Request) -> web.Response:
    out = await request.app[ENGINE_KEY].unload_lora_adapter(await _body(request))
    return web.json_response(out, status=200 if out["success"] else 400)


async def _pause(request: web.Request) -> web.Response:
    body = await _body(request, required=False)
    return web.json_response(await request.app[ENGINE_KEY].pause_generation(body))


async def _continue(request: web.Request) -> web.Response:
    return web.json_response(await request.app[ENGINE_KEY].continue_generation())


async def _update_weight_version(request: web.Request) -> web.Response:
    body = await _body(request)
    return web.json_response(await request.app[ENGINE_KEY].update_weight_version(body))


async def _get_weights_by_name(request: web.Request) -> web.Response:
    body = await _body(request)
    return web.json_response(await request.app[ENGINE_KEY].get_weights_by_name(body))


async def _flush_cache(request: web.Request) -> web.Response:
    ok = request.app[ENGINE_KEY].flush_cache()
    return web.Response(text=_FLUSH_TEXT, status=200 if ok else 400)


async def _abort_request(request: web.Request) -> web.Response:
    await request.app[ENGINE_KEY].abort_request(await _body(request))
    return web.Response(status=200)


def make_app(engine: LocalEngine) -> web.Application:
    app = web.Application(middlewares=[traced, _invalid_to_400], client_max_size=64 * 1024**2)
    app[ENGINE_KEY] = engine
    app[METRICS_KEY] = EngineMetrics(engine)
    r = app.router
    for path in ("/generate",):
        r.add_post(path, _generate)
        r.add_put(path, _generate)
    r.add_get("/health", _health)
    r.add_get("/health_generate", _health_generate)
    r.add_get("/model_info", _model_info)
    r.add_get("/get_model_info", _model_info)
    r.add_post("/update_weights_from_disk", _update_weights_from_disk)
    r.add_post("/init_weights_update_group", _init_weights_update_group)
    r.add_post("/update_weights_from_distributed", _update_weights_from_distributed)
    r.add_post("/destroy_weights_update_group", _destroy_weights_update_group)
    r.add_get("/weights_checksum", _weights_checksum)  # local engine only
    r.add_post("/get_weights_by_name", _get_weights_by_name)
    r.add_post("/load_lora_adapter", _load_lora_adapter)
    r.add_post("/unload_lora_adapter", _unload_lora_adapter)
    r.add_post("/pause_generation", _pause)
    r.add_post("/continue_generation", _continue)
    r.add_post("/update_weight_version", _update_weight_version)
    r.add_get("/flush_cache", _flush_cache)
    r.add_post("/flush_cache", _flush_cache)
    r.add_post("/abort_request", _abort_request)
    r.add_get("/metrics", _metrics)
    return app


@dataclass
class RunningServer:
    """A started engine server; `url` carries the real port when 0 was asked for."""

    engine: LocalEngine
    runner: web.AppRunner
    url: str

    async def close(self) -> None:
        await self.engine.close()
        await self.runner.cleanup()


async def start_server(
    engine: LocalEngine, host: str = "127.0.0.1", port: int = 30000
) -> RunningServer:
    """Serve `engine` over HTTP and return once it listens."""
    runner = web.AppRunner(make_app(engine), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    real_port = runner.addresses[0][1]
    engine.scheduler.start()
    url_host = f"[{host}]" if ":" in host else host
    return RunningServer(engine=engine, runner=runner, url=f"http://{url_host}:{real_port}")


async def serve(
    model_path: Path,
    settings: EngineSettings | None = None,
    *,
    ready: asyncio.Event | None = None,
    on_ready: Callable[[str], None] | None = None,
) -> None:
    """Load the model and serve it until cancelled, SIGTERM or SIGINT (then return normally).

    Once listening it calls `on_ready(url)` (the URL carries the real port when port is 0);
    by default that prints the one line `engine ready on URL` to stdout, which launchers wait
    for. `ready`, if given, is set at the same moment.
    """
    s = settings or EngineSettings()
    # Loading takes a while (torch, transformers, the weights): keep the event loop free.
    engine = await asyncio.to_thread(
        LocalEngine,
        model_path,
        threads=s.threads,
        max_batch=s.max_batch,
        prefix_cache_tokens=s.prefix_cache_tokens,
    )
    server = await start_server(engine, s.host, s.port)
    log.info("engine listening", url=server.url, model_path=str(model_path))
    stop = asyncio.Event()
    signals = _stop_on_signals(stop)
    try:
        (on_ready or _announce)(server.url)
        if ready is not None:
            ready.set()
        await stop.wait()
        log.info("engine stopping", reason="signal")
    finally:
        loop = asyncio.get_running_loop()
        for sig in signals:
            loop.remove_signal_handler(sig)
        await server.close()


def _announce(url: str) -> None:
    print(f"engine ready on {url}", flush=True)


def _stop_on_signals(stop: asyncio.Event) -> list[signal.Signals]:
    """Turn SIGTERM/SIGINT into a clean stop, when we own the main thread's signals."""
    if threading.current_thread() is not threading.main_thread():
        return []
    loop = asyncio.get_running_loop()
    installed = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        try:
            loop.add_signal_handler(sig, stop.set)
        except (NotImplementedError, RuntimeError):  # not on this platform / loop
            continue
        installed.append(sig)
    return installed
