"""One job's trace as the trace tests see it: a real OTLP/HTTP receiver on loopback
(``OtlpReceiver``) takes what `agentarium` commands run as children (``run_agentarium``) export
through ``OTEL_EXPORTER_OTLP_ENDPOINT``, and ``one_job_trace`` checks that the spans the
producer's ``publish tasks`` span roots form one whole trace (tests/test_one_trace.py with the
local engine, tests/test_vllm_trace.py with vLLM)."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan

REPO = Path(__file__).resolve().parents[1]


class OtlpReceiver:
    """An OTLP/HTTP trace receiver on loopback: ``POST /v1/traces`` of protobuf bodies, decoded
    with opentelemetry-proto, each span kept with its resource's ``service.name``."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, ProtoSpan]] = []
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> None:
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_post("/v1/traces", self._traces)
        app.router.add_post("/v1/metrics", lambda request: web.Response(body=b""))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf", request.content_type
        body = ExportTraceServiceRequest()
        body.ParseFromString(await request.read())
        async with self._changed:
            for resource in body.resource_spans:
                service = next(
                    a.value.string_value
                    for a in resource.resource.attributes
                    if a.key == "service.name"
                )
                for scope in resource.scope_spans:
                    self.spans.extend((service, span) for span in scope.spans)
            self._changed.notify_all()
        return web.Response(body=b"", content_type="application/x-protobuf")

    async def wait_for(self, predicate: Callable[[], bool], timeout: float = 60) -> None:
        try:
            async with self._changed:
                await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
        except TimeoutError:
            held = sorted({(service, span.name) for service, span in self.spans})
            raise AssertionError(f"the receiver holds only {held}") from None


async def run_agentarium(*argv: str, env: dict[str, str]) -> str:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentarium", *argv, env=env, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 240)
    assert proc.returncode == 0, f"agentarium {argv[0]}: {err.decode()[-3000:]}"
    return out.decode()


def one_job_trace(receiver, services: set[str]):
    """The spans of the trace the producer's ``publish tasks`` span roots, checked: unique ids,
    every parent present, that span the one root, and ``services`` exactly; returns them and a
    ``parent(span)`` lookup giving the parent's (service, span)."""
    (publish,) = [s for _, s in receiver.spans if s.name == "publish tasks"]
    trace = [(service, s) for service, s in receiver.spans if s.trace_id == publish.trace_id]
    by_id = {s.span_id: (service, s) for service, s in trace}
    assert len(by_id) == len(trace), "span ids are unique"
    roots = [s for _, s in trace if not s.parent_span_id]
    assert [s.name for s in roots] == ["publish tasks"]
    for service, span in trace:
        if span.parent_span_id:
            assert span.parent_span_id in by_id, f"{service} {span.name}: parent not in the trace"
    assert {service for service, _ in trace} == services

    def parent(span: ProtoSpan) -> tuple[str, ProtoSpan]:
        return by_id[span.parent_span_id]

    return trace, parent
