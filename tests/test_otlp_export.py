"""Spans leave the process over OTLP/HTTP when OTEL_EXPORTER_OTLP_ENDPOINT is set: a real
`agentarium produce` process exports its `publish tasks` spans to a receiver on loopback."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


async def test_produce_exports_publish_spans_over_otlp(nats_url, tmp_path):
    received: list[ExportTraceServiceRequest] = []
    arrived = asyncio.Event()

    async def traces(request: web.Request) -> web.Response:
        body = ExportTraceServiceRequest()
        body.ParseFromString(await request.read())
        received.append(body)
        arrived.set()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text("\n".join(json.dumps({"task_id": f"t{i}", "prompt": "hi"}) for i in range(3)))
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_SERVICE_NAME="producer-under-test",
    )
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "agentarium",
            "produce",
            "--agent",
            "toy",
            "--file",
            str(tasks),
            "--nats-url",
            nats_url,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        await asyncio.wait_for(arrived.wait(), 10)  # flushed at exit by the batch processor
    finally:
        await runner.cleanup()
    spans = [
        (resource.resource, span)
        for request in received
        for resource in request.resource_spans
        for scope in resource.scope_spans
        for span in scope.spans
    ]
    publishes = [span for _, span in spans if span.name == "publish tasks"]
    assert len(publishes) == 3
    service = {
        a.value.string_value for res, _ in spans for a in res.attributes if a.key == "service.name"
    }
    assert service == {"producer-under-test"}
    assert all(span.kind == span.SPAN_KIND_PRODUCER for span in publishes)


async def test_metrics_leave_the_process_over_otlp(tmp_path):
    """setup_tracing also installs a MeterProvider when an OTLP endpoint is set, so the
    trainer's OpenTelemetry gauges reach a collector (they were no-ops before)."""
    from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
        ExportMetricsServiceRequest,
    )

    received: list[ExportMetricsServiceRequest] = []
    arrived = asyncio.Event()

    async def metrics(request: web.Request) -> web.Response:
        body = ExportMetricsServiceRequest()
        body.ParseFromString(await request.read())
        received.append(body)
        arrived.set()
        return web.Response(body=b"", content_type="application/x-protobuf")

    app = web.Application()
    app.router.add_post("/v1/metrics", metrics)
    app.router.add_post("/v1/traces", lambda request: web.Response(body=b""))
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    port = runner.addresses[0][1]
    code = (
        "from agentarium.broker import setup_tracing, shutdown_tracing\n"
        "from agentarium.trainer.metrics import MetricsSink\n"
        "setup_tracing('trainer-under-test')\n"
        "sink = MetricsSink(None, attributes={'run': 'r', 'agent': 'a'})\n"
        "from opentelemetry import metrics\n"
        "metrics.get_meter('agentarium.trainer').create_counter('agentarium.test.ping').add(1)\n"
        "shutdown_tracing()\n"
    )
    env = dict(os.environ, OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}")
    try:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, env=env, stderr=subprocess.PIPE
        )
        _, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()[-2000:]
        await asyncio.wait_for(arrived.wait(), 10)  # the last export runs at shutdown
    finally:
        await runner.cleanup()
    names = {
        metric.name
        for request in received
        for resource in request.resource_metrics
        for scope in resource.scope_metrics
        for metric in scope.metrics
    }
    assert "agentarium.test.ping" in names
