"""One trace from producer to engine (docs/observability.md, "One trace per job").

A real OTLP/HTTP receiver in the test process takes what three real processes export through
``OTEL_EXPORTER_OTLP_ENDPOINT`` (``agentarium produce``, ``agentarium consumer --burst``, the local
engine ``agentarium engine``): one job is one trace holding the producer's, the consumer's and the
engine's spans, every parent present, linked producer -> consumer -> engine. The engine's
own spans (queue wait, prefill, decode, and the stalls a weight update or a pause causes) are
checked in-process, against the session's in-memory exporter.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from opentelemetry.proto.trace.v1.trace_pb2 import Span as ProtoSpan
from otlp import OtlpReceiver, one_job_trace, run_agentarium

from agentarium.inference.engine import LocalEngine, start_server

REPO = Path(__file__).resolve().parents[1]
TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01"


@pytest.mark.long(20)
async def test_one_job_is_one_trace_from_producer_to_engine(nats_url, tiny_dir, tmp_path):
    receiver = OtlpReceiver()
    await receiver.start()
    env = dict(
        os.environ,
        OTEL_EXPORTER_OTLP_ENDPOINT=receiver.url,
        OTEL_BSP_SCHEDULE_DELAY="100",  # ms: spans leave soon, not only at exit
        OMP_NUM_THREADS="1",
    )
    engine = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentarium", "engine", "--model", "tiny", "--port", "0",
        env={**env, "OTEL_SERVICE_NAME": "engine-under-test"}, cwd=REPO,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        assert engine.stdout is not None
        line = (await asyncio.wait_for(engine.stdout.readline(), 240)).decode()
        assert line.startswith("engine ready on http://"), line
        url = line.split(" on ", 1)[1].strip()
        tasks = tmp_path / "tasks.jsonl"
        tasks.write_text(json.dumps({"task_id": "t0", "prompt": "repeat 7", "answer": "7"}))
        await run_agentarium(
            "produce", "--agent", "toy", "--file", str(tasks), "--nats-url", nats_url,
            env={**env, "OTEL_SERVICE_NAME": "producer-under-test"},
        )  # fmt: skip
        await run_agentarium(
            "consumer", "--agent", "toy=agentarium.examples.toy:rollout", "--llm", url,
            "--model", "tiny", "--burst", "--nats-url", nats_url,
            env={**env, "OTEL_SERVICE_NAME": "consumer-under-test"},
        )  # fmt: skip
        engine.terminate()  # SIGTERM: the engine stops cleanly and flushes its last spans
        assert await asyncio.wait_for(engine.wait(), 60) == 0

        def names() -> set[str]:
            return {span.name for _, span in receiver.spans}

        wanted = {"publish tasks", "rollout", "chat tiny", "POST /generate", "engine.decode"}
        await receiver.wait_for(lambda: wanted <= names())
    finally:
        if engine.returncode is None:
            engine.kill()
            await engine.wait()
        await receiver.close()

    trace, parent = one_job_trace(
        receiver, {"producer-under-test", "consumer-under-test", "engine-under-test"}
    )

    # producer -> consumer -> engine, through the links a viewer draws
    (server_service, server) = next((v, s) for v, s in trace if s.name == "POST /generate")
    assert server_service == "engine-under-test" and server.kind == ProtoSpan.SPAN_KIND_SERVER
    chat_service, chat = parent(server)
    assert (chat_service, chat.name, chat.kind) == (
        "consumer-under-test",
        "chat tiny",
        ProtoSpan.SPAN_KIND_CLIENT,
    )
    chain = [server.name, chat.name]
    span = chat
    while span.parent_span_id:
        service, span = parent(span)
        chain.append(span.name)
    assert chain[-1] == "publish tasks" and "rollout" in chain, chain
    assert parent(next(s for _, s in trace if s.name == "rollout"))[0] == "producer-under-test"
    phases = {s.name: s for _, s in trace if s.parent_span_id == server.span_id}
    assert {"engine.queue", "engine.prefill", "engine.decode"} <= set(phases), set(phases)
    queue, prefill, decode = (
        phases[n] for n in ("engine.queue", "engine.prefill", "engine.decode")
    )
    assert server.start_time_unix_nano <= queue.start_time_unix_nano
    assert queue.end_time_unix_nano <= prefill.start_time_unix_nano
    assert prefill.end_time_unix_nano <= decode.start_time_unix_nano
    assert decode.end_time_unix_nano <= server.end_time_unix_nano


def _spans(exporter, name: str) -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


async def test_a_weight_update_shows_on_the_requests_it_held(tiny_dir, span_exporter):
    """A request that waited through a pause and a weight update has an ``engine.stalled``
    child per stall, the update's linked to its ``engine.weight_update`` span, which continues
    the update call's traceparent."""
    engine = LocalEngine(tiny_dir)
    server = await start_server(engine, port=0)
    try:
        async with aiohttp.ClientSession() as http:

            async def post(path: str, body: dict, traceparent: str | None = None) -> dict:
                headers = {"traceparent": traceparent} if traceparent else {}
                async with http.post(server.url + path, json=body, headers=headers) as resp:
                    assert resp.status == 200, await resp.text()
                    return await resp.json()

            await post("/pause_generation", {"mode": "in_place"})
            held = asyncio.create_task(
                post(
                    "/generate",
                    # ignore_eos: 3 sampled tokens of the random tiny model end on one of
                    # its 2 stop ids with p ~ 2% (finish_reason "stop", not "length")
                    {
                        "input_ids": [1, 2, 3],
                        "sampling_params": {"max_new_tokens": 3, "ignore_eos": True},
                    },
                    TRACEPARENT,
                )
            )
            await engine.scheduler.wait_for(lambda: engine.scheduler.num_waiting == 1)
            update = "00-11111111111111111111111111111111-2222222222222222-01"
            reply = await post("/update_weights_from_disk", {"model_path": str(tiny_dir)}, update)
            assert reply["success"], reply
            await post("/continue_generation", {})
            out = await asyncio.wait_for(held, 60)
            assert out["meta_info"]["finish_reason"]["type"] == "length"
    finally:
        await server.close()

    # Spans are picked by their traces, not their names alone: the exporter is the session's,
    # and a span another test's server ends late would be counted too.
    def in_trace(name: str, traceparent: str) -> list:
        trace_id = traceparent.split("-")[1]
        return [
            s for s in _spans(span_exporter, name) if format(s.context.trace_id, "032x") == trace_id
        ]

    (update_server,) = in_trace("POST /update_weights_from_disk", update)
    assert format(update_server.parent.span_id, "016x") == "2222222222222222"
    (weight_update,) = in_trace("engine.weight_update", update)
    assert weight_update.parent.span_id == update_server.context.span_id
    (request,) = in_trace("POST /generate", TRACEPARENT)
    assert request.attributes["agentarium.engine.stalls"] == 2
    stalled = {
        s.attributes["agentarium.engine.stall"]: s
        for s in _spans(span_exporter, "engine.stalled")
        if s.parent.span_id == request.context.span_id
    }
    assert set(stalled) == {"paused", "weight update"}
    (link,) = stalled["weight update"].links
    assert link.context.span_id == weight_update.context.span_id
    assert not stalled["paused"].links
    # the request waited from its arrival to the continue: its queue span covers both stalls
    (queue,) = [
        s
        for s in _spans(span_exporter, "engine.queue")
        if s.parent.span_id == request.context.span_id
    ]
    for stall in stalled.values():
        assert queue.start_time <= stall.start_time <= stall.end_time <= queue.end_time


async def test_untraced_requests_make_no_engine_spans(tiny_dir, span_exporter):
    """GET routes (health probes, /metrics, /model_info) are not traced; a POST without a
    traceparent is a root span of its own."""
    server = await start_server(LocalEngine(tiny_dir), port=0)
    try:
        async with aiohttp.ClientSession() as http:
            for path in ("/health", "/model_info", "/metrics"):
                async with http.get(server.url + path) as resp:
                    assert resp.status == 200
            body = {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}
            async with http.post(server.url + "/generate", json=body) as resp:
                assert resp.status == 200
    finally:
        await server.close()
    names = [s.name for s in span_exporter.get_finished_spans()]
    assert not [n for n in names if n.startswith("GET ")], names
    (root,) = _spans(span_exporter, "POST /generate")
    assert root.parent is None


async def test_every_http_client_sends_the_current_traceparent():
    """The consumers' HTTP client (SGLang, the local engine), the OpenAI-compatible backend
    (vLLM), the engines' control client and the AgentBench bridge each put the current span's
    ``traceparent`` on their requests."""
    from opentelemetry import trace

    from agentarium.consumers.backends import GenerateRequest, OpenAICompatBackend
    from agentarium.consumers.backends.http import HttpPool
    from agentarium.environments.agentbench_http import request as agentbench_request
    from agentarium.inference import EngineControl

    seen: dict[str, str] = {}

    async def record(request: web.Request) -> web.Response:
        seen[request.path] = request.headers.get("traceparent", "")
        return web.json_response(
            {"choices": [{"message": {"content": "hi"}, "finish_reason": "stop"}], "usage": {}}
        )

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", record)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    pool, control = HttpPool(), EngineControl()
    vllm = OpenAICompatBackend(f"{url}/v1", "m")
    try:
        with trace.get_tracer("test").start_as_current_span("caller") as span:
            await pool.request("POST", f"{url}/generate", b"{}")
            await vllm.generate(
                GenerateRequest(input_ids=[], messages=[{"role": "user", "content": "x"}])
            )
            await control.model_info(url)
            async with aiohttp.ClientSession() as http:
                await agentbench_request(http, f"{url}/api", "/interact", {"x": 1}, lost=True)
        ctx = span.get_span_context()
        expected = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
        # outside any span: nothing is sent
        await pool.request("POST", f"{url}/untraced", b"{}")
    finally:
        await pool.close()
        await control.close()
        await vllm.aclose()
        await runner.cleanup()
    assert seen == {
        "/generate": expected,
        "/v1/chat/completions": expected,
        "/model_info": expected,
        "/api/interact": expected,
        "/untraced": "",
    }
