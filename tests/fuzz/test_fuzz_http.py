"""The fuzzed HTTP corpus: malformed requests to the local engine (SGLang's API) and to a
rollout's tracing proxy (OpenAI's chat completions and Responses, Anthropic's Messages), served
by the real engine on the tiny model. Every one must get a 4xx whose message says what was wrong (or, for odd but
well-formed chat content a template may render, a 200), never a 5xx, and both servers must go
on serving.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import aiohttp
import corpus
import pytest
from corpus import Request, draw
from worker_env import tiny_template

from agentarium.consumers.backends.sglang import SGLangBackend
from agentarium.consumers.tracing.llm import TracingLLM
from agentarium.consumers.tracing.proxy import TracingProxy
from agentarium.inference.engine import LocalEngine, start_server

PER_KIND = 40


@pytest.fixture
async def engine_url(tiny_dir):
    """The real local engine on the tiny model, in this process (no interpreter to start)."""
    running = await start_server(LocalEngine(tiny_dir, threads=1, max_batch=8), "127.0.0.1", 0)
    try:
        yield running.url
    finally:
        await running.close()


async def send(http: aiohttp.ClientSession, url: str, request: Request) -> tuple[int, str]:
    headers = {"Content-Type": "application/json"}
    async with http.post(url, data=request.body, headers=headers) as resp:
        return resp.status, await resp.text()


def message_of(text: str) -> str:
    """The error message of a 4xx body: SGLang's and OpenAI's shape {"error": {"message"}}
    (the weight routes answer {"success": false, "message"})."""
    try:
        body = json.loads(text)
    except ValueError:
        return ""
    if not isinstance(body, dict):
        return ""
    error = body.get("error")
    if isinstance(error, dict):
        return str(error.get("message") or "")
    return str(body.get("message") or "")


def judge(request: Request, status: int, text: str) -> str | None:
    """None when the answer is right, else what is wrong with it."""
    if request.lenient and status == 200:
        return None
    if not 400 <= status < 500:
        return f"status {status}: {text[:200]}"
    message = message_of(text)
    if not message:
        return f"status {status} without a message: {text[:200]}"
    if request.reason and not any(word in message for word in request.reason):
        return f"status {status}, message does not say {request.reason}: {message[:200]}"
    return None


@pytest.mark.timeout(180)
async def test_fuzzed_engine_requests_get_a_4xx_that_says_why(engine_url):
    started = time.monotonic()
    requests: list[Request] = []
    for kind in corpus.GENERATE_DEFECTS:
        requests += draw(corpus.generate_requests(kind), PER_KIND)
    requests += draw(corpus.control_requests(), PER_KIND)
    wrong = []
    async with aiohttp.ClientSession() as http:
        for request in requests:
            status, text = await send(http, engine_url + request.path, request)
            if (why := judge(request, status, text)) is not None:
                wrong.append(f"{request.category} {request.body[:150]!r}: {why}")
        # still serving: a valid request generates
        # ignore_eos: the random tiny model can sample its EOS first (1 in 263 were it uniform)
        body = {
            "input_ids": [1, 2, 3],
            "sampling_params": {"max_new_tokens": 2, "ignore_eos": True},
        }
        async with http.post(engine_url + "/generate", json=body) as resp:
            assert resp.status == 200 and len((await resp.json())["output_ids"]) == 2
    assert not wrong, f"{len(wrong)} of {len(requests)} wrong:\n" + "\n".join(wrong[:25])
    print(f"\nfuzzed engine requests: {len(requests)} in {time.monotonic() - started:.1f}s")
    for category, n in sorted(Counter(r.category for r in requests).items()):
        print(f"  {n:5d}  {category}")


@pytest.mark.timeout(180)
async def test_fuzzed_chat_requests_to_the_tracing_proxy_get_a_4xx_that_says_why(engine_url):
    started = time.monotonic()
    requests: list[Request] = []
    for kind in corpus.CHAT_DEFECTS:
        requests += draw(corpus.chat_requests(kind), PER_KIND)
    for kind in corpus.GATEWAY_DEFECTS:
        requests += draw(corpus.gateway_requests(kind), PER_KIND)
    backend = SGLangBackend([engine_url], retries=1, backoff=0.01, max_backoff=0.05)
    proxy = TracingProxy(host="127.0.0.1", port=0, advertised_host="127.0.0.1")
    await proxy.start()
    llm = TracingLLM(backend, tiny_template(), model_name="tiny")
    wrong = []
    try:
        with proxy.register("fuzz-job", llm):
            endpoint = proxy.endpoint_for("fuzz-job")
            async with aiohttp.ClientSession() as http:
                for request in requests:
                    status, text = await send(http, endpoint + request.path, request)
                    if (why := judge(request, status, text)) is not None:
                        wrong.append(f"{request.category} {request.body[:150]!r}: {why}")
                # no job id, or another one: refused
                for url, headers in (
                    (f"{proxy.base_url}/v1/chat/completions", {}),
                    (f"{proxy.base_url}/v1/chat/completions", {"Authorization": "Bearer nope"}),
                    (f"{proxy.base_url}/rollouts/other-job/v1/chat/completions", {}),
                ):
                    async with http.post(url, json=corpus.CHAT, headers=headers) as resp:
                        assert 400 <= resp.status < 500, (url, resp.status)
                # still serving
                async with http.post(endpoint + "/chat/completions", json=corpus.CHAT) as resp:
                    assert resp.status == 200, await resp.text()
                    assert (await resp.json())["choices"][0]["message"]["role"] == "assistant"
    finally:
        await proxy.stop()
        await backend.aclose()
    assert not wrong, f"{len(wrong)} of {len(requests)} wrong:\n" + "\n".join(wrong[:25])
    print(f"\nfuzzed proxy requests: {len(requests)} in {time.monotonic() - started:.1f}s")
    for category, n in sorted(Counter(r.category for r in requests).items()):
        print(f"  {n:5d}  {category}")
