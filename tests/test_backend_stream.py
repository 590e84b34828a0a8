"""Streamed generation: the HTTP client's streams (consumers/backends/http.py) against servers
written here byte for byte, then SGLangBackend and VLLMBackend streaming from SGLang's fake
(tests/fake_sglang.py, both of SGLang's shapes) and a vLLM stand-in, and the local engine.

What a streamed call must keep: the result is the unstreamed call's; chunks come before the end,
their text a prefix of the result's (an incomplete character or a stop string's beginning held
back); a failure before the first chunk is retried, after it raised; a stream left early drops
its connection and asks the server to abort the request."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import orjson
import pytest
from aiohttp import web
from fake_sglang import FakeSGLang
from httplib import ok, read_request

from agentarium.consumers.backends import CrossSamplingBackend, SGLangBackend, VLLMBackend
from agentarium.consumers.backends.base import GenerateChunk, GenerateRequest, streams
from agentarium.consumers.backends.http import HttpError, HttpPool, SseParser
from agentarium.consumers.backends.sglang import SGLangStream
from agentarium.consumers.errors import BackendUnavailable, BadRequest
from agentarium.formats import HeldText, IncrementalDecode

# ---- the HTTP client's streams ---------------------------------------------------------------


def test_sse_events_in_any_pieces():
    stream = (
        b": a comment\r\n"
        b'data: {"a": 1}\r\n\r\n'
        b"event: ignored\nid: 7\ndata: two\ndata:lines\n\n"
        b"retry: 5\n\n"  # no data: no event
        b"data: [DONE]\n\n"
        b"data: never ended"
    )
    events = [b'{"a": 1}', b"two\nlines", b"[DONE]"]
    assert SseParser().feed(stream) == events  # several events in one read
    for size in (1, 2, 3, 7):  # an event's bytes split over reads at every place
        parser = SseParser()
        got = [e for at in range(0, len(stream), size) for e in parser.feed(stream[at : at + size])]
        assert got == events, size


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def test_a_chunked_stream_arrives_as_it_is_written_and_leaves_the_connection_reusable(
    serve,
):
    seen = asyncio.Event()

    async def sse(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n")
        writer.write(b"Transfer-Encoding: chunked\r\n\r\n")
        writer.write(_chunk(b'data: {"n": 1}\n\ndata: {"n"'))  # one event and half another
        await writer.drain()
        await seen.wait()  # the first event reached the client before the rest was sent
        for piece in (b": 2}\r\n\r\n", b"da", b"ta: [DONE]\n\n"):
            await asyncio.sleep(0.005)
            writer.write(_chunk(piece)[:3])  # a chunk's size line cut in two
            await writer.drain()
            await asyncio.sleep(0.005)
            writer.write(_chunk(piece)[3:])
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        path, _ = await read_request(reader)
        writer.write(ok(b'{"again": true}'))
        await writer.drain()

    url, stats = await serve(sse)
    pool = HttpPool()
    events = []
    async with pool.stream("POST", f"{url}/generate", b'{"stream": true}') as response:
        assert response.status == 200 and response.headers["content-type"] == "text/event-stream"
        async for data in response.events():
            events.append(orjson.loads(data) if data != b"[DONE]" else data)
            seen.set()
    assert events == [{"n": 1}, {"n": 2}, b"[DONE]"]
    assert (await pool.request("GET", f"{url}/x")).json() == {"again": True}
    assert stats["connections"] == 1  # read to its end, the stream left the connection reusable
    await pool.close()


async def test_content_length_and_until_close_bodies_stream(serve):
    async def sized(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 12\r\n\r\ndata: a\n\n")
        await writer.drain()
        await asyncio.sleep(0.01)
        writer.write(b"abc")
        await writer.drain()
        await read_request(reader)
        writer.write(b"HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\ndata: b\n\n")
        await writer.drain()

    url, stats = await serve(sized)
    pool = HttpPool()
    async with pool.stream("GET", f"{url}/a") as response:
        assert await response.read() == b"data: a\n\n"
        assert await response.read() == b"abc"
        assert await response.read() == b""
    async with pool.stream("GET", f"{url}/b") as response:
        assert response.status == 503 and await response.body() == b"data: b\n\n"
    assert stats["connections"] == 1 and pool.open_connections == 0  # closed: not kept
    await pool.close()


async def test_a_body_read_slowly_pushes_back_and_arrives_whole(serve):
    body = bytes(range(256)) * 16384  # 4 MiB, past the point where the socket is not read

    async def big(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for at in range(0, len(body), 65536):
            writer.write(_chunk(body[at : at + 65536]))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        await _echo(reader, writer)

    url, stats = await serve(big)
    pool = HttpPool()
    async with pool.stream("GET", f"{url}/big") as response:
        await asyncio.sleep(0.2)  # the server writes what the socket takes meanwhile
        assert await response.body() == body
    assert (await pool.request("GET", f"{url}/x")).status == 200 and stats["connections"] == 1
    await pool.close()


async def _echo(reader, writer):
    while True:
        await read_request(reader)
        writer.write(ok(b"{}"))
        await writer.drain()


async def test_a_stream_left_early_cancelled_cut_or_timed_out_drops_its_connection(
    serve,
):
    closed = asyncio.Queue()

    async def endless(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        writer.write(_chunk(b"data: 1\n\n"))
        await writer.drain()
        await reader.read()  # until the client closes
        await closed.put(True)

    url, stats = await serve(endless)
    pool = HttpPool(timeout_s=5)
    async with pool.stream("GET", f"{url}/a") as response:  # the caller stops reading
        assert await response.read() == b"data: 1\n\n"
    assert await closed.get() and pool.open_connections == 0

    started = asyncio.Event()

    async def read_all():
        async with pool.stream("GET", f"{url}/b") as response:
            await response.read()
            started.set()
            await response.read()

    task = asyncio.create_task(read_all())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert await closed.get() and pool.open_connections == 0

    with pytest.raises(RuntimeError):  # an exception in the caller's block
        async with pool.stream("GET", f"{url}/c") as response:
            raise RuntimeError
    assert await closed.get() and pool.open_connections == 0

    async def cut_it():
        await started.wait()
        assert pool.in_flight(url) == 1
        return pool.cut(url)

    started.clear()
    cutter = asyncio.create_task(cut_it())
    with pytest.raises(HttpError, match="cut off"):
        await read_all()
    assert await cutter == 1 and pool.in_flight(url) == 0 and pool.open_connections == 0

    with pytest.raises(TimeoutError):  # the timeout bounds the whole stream
        async with pool.stream("GET", f"{url}/d", timeout_s=0.2) as response:
            assert await response.read() == b"data: 1\n\n"
            await response.read()
    assert pool.open_connections == 0 and stats["connections"] == 5
    await pool.close()


# ---- text held back -----------------------------------------------------------------------


def test_held_text_keeps_back_what_could_still_change():
    held = HeldText(["</answer>", "\n\n"])
    texts = ["The", "The ans", "The answer<", "The answer</", "The answer</ans", "The answer\n"]
    assert [held.release(t) for t in texts] == ["The", " ans", "wer", "", "", ""]
    held = HeldText()
    assert [held.release(t) for t in ["a\ufffd", "a\ufffd\ufffd", "aé", "aéb"]] == [
        "a",
        "",
        "é",
        "b",
    ]


def test_incremental_decode_equals_the_whole_decode(template):
    ids = template.encode("Paris é 東京 ok")
    decoded = IncrementalDecode(template.decode)
    texts = [decoded.add([token]) for token in ids]
    assert texts[-1] == template.decode(ids) and not any("\ufffd" in t for t in texts)


# ---- SGLang's streams --------------------------------------------------------------------


def _sglang_chunk(ids, text, total, finish=None, version="default"):
    triples = [[-0.5, t, None] for t in ids]
    meta = {"id": "r", "finish_reason": finish, "completion_tokens": total}
    meta |= {"weight_version": version, "output_token_logprobs": triples}
    return {"text": text, "output_ids": ids, "meta_info": meta}


@pytest.mark.parametrize(
    ("chunks", "text"),
    [
        # SGLang's incremental shape: the stop string's beginning was sent, the last chunk
        # (trimmed) adds nothing: cut where it began
        ([([1], "Paris", 1), ([2], "<", 2), ([3], "/ans", 3), ([4], "", 4)], "Paris"),
        # a server that held "<" back (the local engine) sends it with the last chunk: kept
        ([([1], "Paris", 1), ([2], "<", 2)], "Paris<"),
        # the whole so far each time (SGLang's default): the last chunk's text, trimmed
        ([([1], "Paris", 1), ([1, 2], "Paris<", 2), ([1, 2, 3], "Paris", 3)], "Paris"),
    ],
)
def test_sglang_chunks_put_together(chunks, text):
    stream = SGLangStream(stops=["</answer>"])
    handed = []
    for i, (ids, piece, total) in enumerate(chunks):
        last = i == len(chunks) - 1
        finish = {"type": "stop", "matched": "</answer>"} if last else None
        handed.append(stream.feed(_sglang_chunk(ids, piece, total, finish)))
    assert handed[-1] is None and stream.finished
    assert stream.response()["text"] == text and stream.response()["output_ids"] == [1, 2, 3, 4][: chunks[-1][2]]  # fmt: skip
    assert text.startswith("".join(c.text for c in handed[:-1]))
    with pytest.raises(ValueError, match="neither the whole output so far nor its new tokens"):
        stream = SGLangStream()
        stream.feed(_sglang_chunk([1, 2], "ab", 2))
        stream.feed(_sglang_chunk([3, 4], "cd", 5))


def _request(rid: str = "job-1", **sampling) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[1, 2, 3], sampling={"max_new_tokens": 64, **sampling}, rid=rid
    )


def _fake(template, text: str, **kwargs) -> FakeSGLang:
    ids = template.encode(text) + template.eos_token_ids[:1]
    return FakeSGLang(reply=lambda body: (ids, text), decode=template.decode, **kwargs)


def _same(a, b) -> None:
    assert replace(a, latency_s=0.0) == replace(b, latency_s=0.0)


@pytest.fixture
async def started():
    servers: list[FakeSGLang] = []

    async def start(fake: FakeSGLang) -> FakeSGLang:
        await fake.start()
        servers.append(fake)
        return fake

    yield start
    for fake in servers:
        await fake.close()


@pytest.mark.parametrize("incremental", [False, True])
async def test_streamed_is_unstreamed_in_both_shapes_and_its_text_is_held_back(
    template, started, incremental
):
    fake = await started(_fake(template, "Paris é</answer> and more", incremental=incremental))
    backend = SGLangBackend([fake.url], backoff=0.0)
    chunks: list[GenerateChunk] = []
    try:
        for sampling in ({}, {"stop": ["</answer>"]}):
            plain = await backend.generate(_request(**sampling))
            chunks.clear()
            streamed = await backend.generate(_request(**sampling), on_chunk=chunks.append)
            _same(streamed, plain)
            assert len(chunks) == len(streamed.output_ids) - 1  # one token a chunk, the last kept
            assert [t for c in chunks for t in c.output_ids] == streamed.output_ids[:-1]
            assert [lp for c in chunks for lp in c.output_logprobs] == streamed.output_logprobs[:-1]
            texts = [c.text for c in chunks]
            assert streamed.text.startswith("".join(texts))
            assert all("\ufffd" not in t for t in texts)
        assert streamed.text == "Paris é" and streamed.meta_info["finish_reason"]["matched"] == "</answer>"  # fmt: skip
        # "<", "</", ... "</answer" were held back: a stop string's beginning is never sent
        assert "".join(texts) == "Paris é" and not any("<" in t for t in texts)
        assert fake.requests[-1]["stream"] is True and "stream" not in fake.requests[-2]
        assert backend.http.open_connections == 1  # every stream read to its end: one connection
    finally:
        await backend.aclose()


async def test_chunks_arrive_before_the_end_and_weight_spans_come_from_the_chunks(
    template, started
):
    fake = await started(_fake(template, "abcdef"))
    fake.hold_streams, fake.hold_after = True, 2
    backend = SGLangBackend([fake.url], backoff=0.0)
    chunks: list[GenerateChunk] = []
    try:
        call = asyncio.create_task(backend.generate(_request(), on_chunk=chunks.append))
        await fake.wait_for_held(1)
        await asyncio.sleep(0.05)
        assert [c.text for c in chunks] == ["a", "b"] and not call.done()
        fake.weight_version = "run:2"  # an update in place while the request runs
        fake.release_streams()
        result = await call
    finally:
        await backend.aclose()
    assert [c.weight_version for c in chunks] == ["default"] * 2 + ["run:2"] * 4
    assert result.weight_version == "run:2"
    assert result.weight_spans == [("default", 0), ("run:2", 2)]  # what SGLang never lists


async def test_a_failure_is_retried_before_the_first_chunk_and_raised_after(template, started):
    fake = await started(_fake(template, "abcdef"))
    backend = SGLangBackend([fake.url], backoff=0.0)
    chunks: list[GenerateChunk] = []
    try:
        fake.failures = [503]
        fake.break_streams, fake.hold_after = 1, 0  # dropped before its first chunk
        result = await backend.generate(_request(), on_chunk=chunks.append)
        assert result.text == "abcdef" and fake.count == 3
        assert [r["rid"] for r in fake.requests] == ["job-1", "job-1-r1", "job-1-r2"]

        fake.aborts = 1  # an abort before any token (a weight update): resubmitted
        chunks.clear()
        assert (await backend.generate(_request(), on_chunk=chunks.append)).text == "abcdef"
        assert fake.count == 5 and len(chunks) == 6

        fake.break_streams, fake.hold_after = 1, 2  # dropped after two chunks were handed on
        chunks.clear()
        with pytest.raises(BackendUnavailable, match="the stream broke after 2 tokens"):
            await backend.generate(_request(), on_chunk=chunks.append)
        assert fake.count == 6 and [c.text for c in chunks] == ["a", "b"]  # not retried

        fake.stream_errors = 1  # SGLang's in-stream error: what unstreamed answers with 400
        with pytest.raises(BadRequest, match="scripted error"):
            await backend.generate(_request(), on_chunk=chunks.append)
        assert fake.count == 7
    finally:
        await backend.aclose()


async def test_cancelling_a_stream_aborts_the_attempts_request_and_drops_its_connection(
    template, started
):
    fake = await started(_fake(template, "abcdef"))
    fake.hold_streams = True
    fake.failures = [503]  # the second attempt streams: its rid is the one to abort
    backend = SGLangBackend([fake.url], backoff=0.0)
    first = asyncio.Event()
    try:
        call = asyncio.create_task(backend.generate(_request(), on_chunk=lambda c: first.set()))
        await first.wait()
        assert backend.http.in_flight(fake.url) == 1
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        assert backend.http.open_connections == 0 and backend.http.in_flight(fake.url) == 0
        deadline = time.monotonic() + 5
        while fake.dropped == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert ("/abort_request", {"rid": "job-1-r1"}) in fake.control
        assert fake.dropped == 1  # the abort ended the held stream; its client had gone

        def refuse(chunk: GenerateChunk) -> None:
            raise RuntimeError("the caller stops here")

        with pytest.raises(RuntimeError, match="the caller stops here"):  # as it was raised
            await backend.generate(_request("job-2"), on_chunk=refuse)
    finally:
        await backend.aclose()  # after the aborts on their way
    assert ("/abort_request", {"rid": "job-2"}) in fake.control


async def test_a_breaker_opening_cuts_a_stream_off_and_it_fails_over(template, started):
    dead = await started(_fake(template, "abcdef"))
    alive = await started(_fake(template, "abcdef"))
    dead.hold_streams = True
    backend = SGLangBackend([dead.url, alive.url], backoff=0.0, retries=0)
    try:
        first = asyncio.Event()
        call = asyncio.create_task(backend.generate(_request(), on_chunk=lambda c: first.set()))
        await first.wait()
        assert backend.open_breaker(dead.url) == 1
        with pytest.raises(BackendUnavailable, match="broke after 1 tokens.*cut off"):
            await call  # a chunk was handed on: not failed over
        dead.hold_after = 0  # held before its first chunk: failed over
        call = asyncio.create_task(backend.generate(_request("job-2"), on_chunk=lambda c: None))
        await dead.wait_for_held(1)
        backend.balancer.release(dead.url)
        backend.open_breaker(dead.url)
        assert (await call).text == "abcdef" and alive.count == 1
    finally:
        dead.release_streams()
        await backend.aclose()


async def test_cross_sampling_streams_through_the_backend_that_serves_the_call(template, started):
    fake = await started(_fake(template, "abc"))
    policy = SGLangBackend([fake.url], backoff=0.0)

    class Whole:  # a backend that does not stream
        async def generate(self, request):
            return replace(await policy.generate(request), text="whole")

    chunks: list[GenerateChunk] = []
    try:
        for ratio, texts in ((0.0, ["a", "b", "c"]), (1.0, [])):
            cross = CrossSamplingBackend(
                policy, Whole(), ratio, primary_name="p", secondary_name="s"
            )
            assert streams(cross)
            chunks.clear()
            await cross.generate(_request(), on_chunk=chunks.append)
            assert [c.text for c in chunks] == texts
        assert not streams(CrossSamplingBackend(Whole(), Whole(), 0.5, primary_name="a", secondary_name="b"))  # fmt: skip
    finally:
        await policy.aclose()


# ---- vLLM's stream, from a stand-in in its shapes ------------------------------------------


async def test_vllm_streamed_is_unstreamed_its_text_decoded_here(template):
    """vLLM's SSE shape (VLLM_API.md): each step's ids and log-probs, ``weight_versions`` on the
    last chunk only, a usage chunk, ``[DONE]``; a cancelled stream is aborted by the id vLLM's
    engine knows."""
    reply = template.encode("Paris é 東京") + template.eos_token_ids[:1]
    requests: list[dict] = []
    hold = asyncio.Event()
    hold.set()

    def choice(ids, finish=None):
        return {
            "index": 0,
            "finish_reason": finish,
            "stop_reason": None,
            "token_ids": ids,
            "weight_versions": [{"version": "v:1", "start": 0, "end": len(reply)}]
            if finish
            else None,  # fmt: skip
            "logprobs": {"content": [{"token_id": t, "logprob": -0.5, "rank": 1} for t in ids]},
        }

    async def generate(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        requests.append(body)
        usage = {"prompt_tokens": 3, "completion_tokens": len(reply), "total_tokens": 3 + len(reply)}  # fmt: skip
        rid = "generate-tokens-" + body["request_id"]
        if not body.get("stream"):
            return web.json_response({"request_id": rid, "usage": usage, "choices": [choice(reply, "stop")]})  # fmt: skip
        assert body["stream_options"] == {"include_usage": True}
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for i, token in enumerate(reply):
            last = i == len(reply) - 1
            chunk = {"request_id": rid, "choices": [choice([token], "stop" if last else None)]}
            await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
            if i == 1:
                await hold.wait()
        tail = {"request_id": rid, "choices": [], "usage": usage}
        await response.write(b"data: " + orjson.dumps(tail) + b"\n\ndata: [DONE]\n\n")
        return response

    async def abort(request: web.Request) -> web.Response:
        requests.append({"abort": await request.json()})
        return web.Response()

    app = web.Application()
    app.router.add_post("/inference/v1/generate", generate)
    app.router.add_post("/inference/v1/abort_requests", abort)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    backend = VLLMBackend([url], decode=template.decode, backoff=0.0)
    chunks: list[GenerateChunk] = []
    try:
        plain = await backend.generate(_request())
        streamed = await backend.generate(_request(), on_chunk=chunks.append)
        _same(streamed, plain)
        assert streamed.text == "Paris é 東京" and streamed.weight_version == "v:1"
        texts = [c.text for c in chunks]
        assert "".join(texts) == "Paris é 東京" and len(chunks) == len(reply) - 1
        assert "" in texts and not any("\ufffd" in t for t in texts)  # bytes of one character

        hold.clear()
        call = asyncio.create_task(backend.generate(_request("job-9"), on_chunk=lambda c: None))
        while len(requests) < 3:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
        while len(requests) < 4:
            await asyncio.sleep(0.01)
        assert requests[3] == {"abort": {"request_ids": ["generate-tokens-job-9"]}}
    finally:
        hold.set()
        await backend.aclose()
        await runner.cleanup()


# ---- the local engine ---------------------------------------------------------------------


async def test_the_local_engine_streams_as_it_answers_and_stops_when_cancelled(
    engine_url, template
):
    backend = SGLangBackend([engine_url], backoff=0.0)
    prompt = template.encode("Hello, 12+34=")
    sampling = {"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 7}
    chunks: list[GenerateChunk] = []
    try:
        plain = await backend.generate(
            GenerateRequest(input_ids=prompt, sampling=sampling, rid="a")
        )
        streamed = await backend.generate(
            GenerateRequest(input_ids=prompt, sampling=sampling, rid="b"), on_chunk=chunks.append
        )
        assert streamed.output_ids == plain.output_ids and streamed.text == plain.text
        # the second call's prompt comes from the prefix cache: within 1e-4 (docs/design.md)
        assert streamed.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-4)
        assert (streamed.finish_reason, streamed.weight_version) == (plain.finish_reason, plain.weight_version)  # fmt: skip
        assert len(chunks) >= 1 and streamed.text.startswith("".join(c.text for c in chunks))

        long = {"max_new_tokens": 2000, "temperature": 1.0, "ignore_eos": True}  # context 2048
        first = asyncio.Event()
        call = asyncio.create_task(
            backend.generate(
                GenerateRequest(input_ids=prompt, sampling=long, rid="long"),
                on_chunk=lambda c: first.set(),
            )
        )
        await asyncio.wait([call, asyncio.create_task(first.wait())], timeout=30, return_when="FIRST_COMPLETED")  # fmt: skip
        assert first.is_set() and not call.done()
        assert await _engine_running(backend, engine_url) == 1
        call.cancel()
        cancelled = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await call
        while await _engine_running(backend, engine_url):
            assert time.monotonic() - cancelled < 1.0, "the engine still generates after 1 s"
            await asyncio.sleep(0.02)
    finally:
        await backend.aclose()


async def _engine_running(backend: SGLangBackend, url: str) -> int:
    """The local engine's running sequences (its Prometheus /metrics)."""
    text = (await backend.control.request("GET", f"{url}/metrics")).text()
    for line in text.splitlines():
        if line.startswith("agentarium_engine_running_sequences"):
            return int(float(line.split()[-1]))
    raise AssertionError("no agentarium_engine_running_sequences in /metrics")
