"""Inference backends against fake servers: wire shapes, balancing, retries, failover, aborts."""

from __future__ import annotations

import asyncio

import pytest
from aiohttp import web
from fake_sglang import FakeSGLang, dead_url

from agentarium.consumers.backends import (
    GenerateRequest,
    OpenAICompatBackend,
    SGLangBackend,
    StickyBalancer,
    parse_generate_response,
)
from agentarium.consumers.errors import BackendUnavailable, BadRequest, LLMError


@pytest.fixture
async def servers():
    started: list[FakeSGLang] = []

    async def make(n: int = 1, **kwargs) -> list[FakeSGLang]:
        for _ in range(n):
            fake = FakeSGLang(**kwargs)
            await fake.start()
            started.append(fake)
        return started[-n:]

    yield make
    for fake in started:
        await fake.close()


@pytest.fixture
async def backends():
    made: list[SGLangBackend] = []

    def make(urls, **kwargs) -> SGLangBackend:
        kwargs.setdefault("backoff", 0.0)
        backend = SGLangBackend(urls, **kwargs)
        made.append(backend)
        return backend

    yield make
    for backend in made:
        await backend.aclose()


def req(key: str = "", rid: str = "job-1-call-0", **sampling) -> GenerateRequest:
    return GenerateRequest(
        input_ids=[1, 2, 3],
        sampling={"max_new_tokens": 8, "temperature": 1.0, **sampling},
        rid=rid,
        route_key=key,
    )


# --- wire shapes ------------------------------------------------------------------------------


async def test_sends_only_sglang_fields_and_parses_meta_info(servers, backends):
    (fake,) = await servers(
        1, output_ids=[5, 6, 7], text="abc", weight_version="12", cached_tokens=2
    )
    backend = backends([fake.url])
    result = await backend.generate(req(stop=["</answer>"], stop_token_ids=[7]))
    (body,) = fake.requests
    assert set(body) == {
        "input_ids",
        "sampling_params",
        "return_logprob",
        "logprob_start_len",
        "rid",
    }
    assert body["input_ids"] == [1, 2, 3]
    assert body["return_logprob"] is True and body["logprob_start_len"] == -1
    assert body["rid"] == "job-1-call-0"
    assert body["sampling_params"] == {
        "max_new_tokens": 8,
        "temperature": 1.0,
        "stop": ["</answer>"],
        "stop_token_ids": [7],
    }
    assert result.output_ids == [5, 6, 7]
    assert result.output_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert len(result.output_logprobs) == len(result.output_ids)
    assert result.text == "abc"
    assert result.finish_reason == "stop"
    assert result.weight_version == "12"
    assert result.cached_tokens == 2 and result.prompt_tokens == 3 and result.completion_tokens == 3
    assert result.backend == fake.url
    assert result.latency_s > 0


def test_parse_the_documented_response_shapes():
    doc = {
        "text": "…decoded output…",
        "output_ids": [1234, 5678, 151645],
        "meta_info": {
            "id": "job-uuid-call-0",
            "finish_reason": {"type": "stop", "matched": 151645},
            "prompt_tokens": 3,
            "completion_tokens": 3,
            "cached_tokens": 0,
            "weight_version": "default",
            "output_token_logprobs": [
                [-0.11, 1234, None],
                [-2.30, 5678, None],
                [-0.01, 151645, None],
            ],
            "e2e_latency": 0.21,
        },
    }
    result = parse_generate_response(doc, url="http://s:1")
    assert result.output_ids == [1234, 5678, 151645]
    assert result.output_logprobs == [-0.11, -2.30, -0.01]
    assert result.finish_reason == "stop" and result.weight_version == "default"

    doc["meta_info"]["finish_reason"] = {"type": "length", "length": 3}
    assert parse_generate_response(doc).finish_reason == "length"
    doc["meta_info"]["finish_reason"] = {
        "type": "abort",
        "message": "x",
        "status_code": None,
        "err_type": None,
    }
    assert parse_generate_response(doc).finish_reason == "abort"

    # Older servers: no output_ids, the ids come from the triples.
    no_ids = {**doc, "output_ids": None}
    assert parse_generate_response(no_ids).output_ids == [1234, 5678, 151645]

    misaligned = {**doc, "output_ids": [1234, 9999, 151645]}
    with pytest.raises(ValueError, match="does not match"):
        parse_generate_response(misaligned)
    short = {**doc, "output_ids": [1234, 5678]}
    with pytest.raises(ValueError, match="not aligned"):
        parse_generate_response(short)
    with pytest.raises(ValueError, match="return_logprob"):
        parse_generate_response({"text": "", "meta_info": {"finish_reason": {"type": "stop"}}})


# --- balancing -----------------------------------------------------------------------------------


async def test_same_route_key_sticks_to_one_server(servers, backends):
    a, b = await servers(2)
    backend = backends([a.url, b.url])
    results = await asyncio.gather(*(backend.generate(req("group-1")) for _ in range(8)))
    assert {r.backend for r in results} == {a.url}
    assert (a.count, b.count) == (8, 0)
    # A second key is bound on first sight to the less loaded server, and stays there.
    for _ in range(4):
        assert (await backend.generate(req("group-2"))).backend == b.url
    assert (a.count, b.count) == (8, 4)


async def test_different_keys_spread_over_servers(servers, backends):
    a, b = await servers(2)
    backend = backends([a.url, b.url])
    owner: dict[str, str] = {}
    for _ in range(3):
        for key in range(10):
            result = await backend.generate(req(f"group-{key}"))
            assert owner.setdefault(f"group-{key}", result.backend) == result.backend
    assert sorted(owner.values()).count(a.url) == 5
    assert (a.count, b.count) == (15, 15)


async def test_least_outstanding_requests(servers, backends):
    a, b = await servers(2)
    a.gate = asyncio.Event()
    backend = backends([a.url, b.url])
    held = asyncio.create_task(backend.generate(req("slow-group")))
    await a.wait_for_requests(1)
    assert backend.balancer.outstanding == {a.url: 1, b.url: 0}
    # While a holds one request, new keys and keyless requests go to the idle server.
    assert (await backend.generate(req("other-group"))).backend == b.url
    assert (await backend.generate(req(""))).backend == b.url
    assert (await backend.generate(req("third-group"))).backend == b.url
    a.gate.set()
    assert (await held).backend == a.url
    assert backend.balancer.outstanding == {a.url: 0, b.url: 0}


def test_route_keys_are_a_bounded_lru():
    balancer = StickyBalancer(["http://a", "http://b"], max_keys=2)
    assert balancer.choose("k1") == "http://a"
    balancer.started("http://a")
    assert balancer.choose("k2") == "http://b"
    balancer.choose("k1")  # refresh k1: k2 is now the oldest
    balancer.choose("k3")
    assert balancer.bound("k2") is None
    assert balancer.bound("k1") == "http://a" and balancer.bound("k3") is not None
    assert balancer.choose("k4", exclude={"http://a", "http://b"}) is None


# --- retries and failover --------------------------------------------------------------------------


async def test_retries_on_5xx_then_succeeds_on_the_same_server(servers, backends):
    a, b = await servers(2)
    a.failures = [503, 500]
    backend = backends([a.url, b.url], retries=3)
    result = await backend.generate(req("g"))
    assert result.backend == a.url
    assert (a.count, b.count) == (3, 0)
    # Each resubmission has its own rid: SGLang refuses a duplicate of a request it may still hold.
    assert [r["rid"] for r in a.requests] == ["job-1-call-0", "job-1-call-0-r1", "job-1-call-0-r2"]


async def test_fails_over_after_retries_and_rebinds_the_key(servers, backends):
    a, b = await servers(2)
    a.failures = [503] * 10
    backend = backends([a.url, b.url], retries=2)
    result = await backend.generate(req("g"))
    assert result.backend == b.url
    assert (a.count, b.count) == (3, 1)
    assert backend.balancer.bound("g") == b.url
    # a is marked down: the group's next samples go straight to b.
    await backend.generate(req("g"))
    assert (a.count, b.count) == (3, 2)


async def test_connection_refused_fails_over(servers, backends):
    (live,) = await servers(1)
    dead = dead_url()
    backend = backends([dead, live.url], retries=1)
    results = [await backend.generate(req(f"g{i}")) for i in range(4)]
    assert {r.backend for r in results} == {live.url}
    assert live.count == 4


async def test_backend_unavailable_after_everything_fails(servers, backends):
    (a,) = await servers(1)
    a.failures = [502] * 10
    dead = dead_url()
    backend = backends([a.url, dead], retries=2)
    with pytest.raises(BackendUnavailable) as info:
        await backend.generate(req("g"))
    assert isinstance(info.value, LLMError)
    assert set(info.value.errors) == {a.url, dead}
    assert "502" in info.value.errors[a.url]
    assert a.count == 3


async def test_timeouts_are_retried(servers, backends):
    (a,) = await servers(1)
    a.gate = asyncio.Event()  # never opened: every attempt times out
    backend = backends([a.url], retries=1, timeout=0.2)
    with pytest.raises(BackendUnavailable, match="Timeout"):
        await backend.generate(req())
    assert a.count == 2


async def test_unusable_response_counts_as_a_server_failure(servers, backends):
    a, b = await servers(2)
    a.misaligned = True
    backend = backends([a.url, b.url], retries=0)
    assert (await backend.generate(req("g"))).backend == b.url


async def test_4xx_is_a_bad_request_and_not_retried(servers, backends):
    a, b = await servers(2)
    a.failures = [400]
    backend = backends([a.url, b.url], retries=3)
    with pytest.raises(BadRequest) as info:
        await backend.generate(req("g"))
    assert info.value.status == 400 and info.value.url == a.url
    assert (a.count, b.count) == (1, 0)
    with pytest.raises(BadRequest, match="input_ids"):
        await backend.generate(GenerateRequest(input_ids=[], sampling={}))


# --- aborts ------------------------------------------------------------------------------------------


async def test_empty_abort_is_resubmitted(servers, backends):
    (a,) = await servers(1)
    a.aborts = 2
    backend = backends([a.url], abort_retries=3)
    result = await backend.generate(req())
    assert result.finish_reason == "stop" and result.output_ids == [11, 12, 13]
    assert a.count == 3


async def test_abort_with_tokens_or_too_many_aborts_is_returned(servers, backends):
    (a,) = await servers(1)
    backend = backends([a.url], abort_retries=2)
    a.partial_aborts = 1
    partial = await backend.generate(req())
    assert partial.finish_reason == "abort" and partial.output_ids == [11]
    assert len(partial.output_logprobs) == 1
    a.aborts = 5
    before = a.count
    exhausted = await backend.generate(req())
    assert exhausted.finish_reason == "abort" and exhausted.output_ids == []
    assert a.count - before == 3


# --- helpers and lifecycle ---------------------------------------------------------------------------


async def test_health_and_model_info(servers, backends):
    (a,) = await servers(1, weight_version="4")
    dead = dead_url()
    backend = backends([dead, a.url])
    assert await backend.health() == {dead: False, a.url: True}
    info = await backend.model_info()
    assert info["weight_version"] == "4" and info["is_generation"] is True
    with pytest.raises(BackendUnavailable):
        await backends([dead]).model_info()


async def test_one_lazy_pool_with_kept_alive_connections_closed_by_aclose(servers):
    (a,) = await servers(1)
    backend = SGLangBackend([a.url], backoff=0.0)
    assert backend._http is None
    await backend.generate(req())
    pool = backend.http
    await backend.generate(req())
    assert backend.http is pool and pool.open_connections == 1  # the connection was reused
    await backend.aclose()
    assert pool.closed and pool.open_connections == 0
    await backend.generate(req())  # a closed backend opens a new pool when used again
    assert backend.http is not pool
    await backend.aclose()


# --- OpenAI-compatible backend ------------------------------------------------------------------------


@pytest.fixture
async def openai_server():
    seen: list[dict] = []
    headers: list[str] = []
    failures = [503]

    async def completions(request: web.Request) -> web.Response:
        seen.append(await request.json())
        headers.append(request.headers.get("Authorization", ""))
        if failures:
            return web.json_response({"error": "busy"}, status=failures.pop())
        if seen[-1].get("max_tokens") == 1:
            return web.json_response({"error": {"message": "bad"}}, status=422)
        call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
        return web.json_response(
            {
                "id": "chatcmpl-1",
                "object": "chat.completion",
                "model": "gpt-x",
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "hi", "tool_calls": [call]},
                        "finish_reason": "tool_calls",
                    }
                ],
                "usage": {"prompt_tokens": 9, "completion_tokens": 2, "total_tokens": 11},
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1", seen, headers
    await runner.cleanup()


async def test_openai_compat_backend_is_text_in_text_out(openai_server):
    base_url, seen, headers = openai_server
    backend = OpenAICompatBackend(base_url, "gpt-x", api_key="sk-test", backoff=0.0)
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    request = GenerateRequest(
        input_ids=[],
        sampling={
            "max_new_tokens": 5,
            "temperature": 0.5,
            "top_p": 1.0,
            "top_k": -1,
            "stop_token_ids": [9],
        },
        messages=[{"role": "user", "content": "hello"}],
        tools=tools,
    )
    try:
        result = await backend.generate(request)
        assert len(seen) == 2  # the 503 was retried
        body = seen[-1]
        assert body == {
            "model": "gpt-x",
            "messages": [{"role": "user", "content": "hello"}],
            "temperature": 0.5,
            "top_p": 1.0,
            "max_tokens": 5,
            "tools": tools,
        }
        assert headers[-1] == "Bearer sk-test"
        assert result.output_ids == [] and result.output_logprobs == []
        assert result.text == "hi" and result.finish_reason == "stop"
        assert result.tool_calls[0]["function"]["name"] == "add"
        assert result.prompt_tokens == 9 and result.completion_tokens == 2
        with pytest.raises(BadRequest):
            await backend.generate(
                GenerateRequest(
                    input_ids=[], sampling={"max_new_tokens": 1}, messages=request.messages
                )
            )
    finally:
        await backend.aclose()
