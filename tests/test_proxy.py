"""TracingProxy: the real OpenAI SDK against the per-rollout endpoint records what llm.chat does."""

from __future__ import annotations

import asyncio
import json
import socket

import aiohttp
import openai
import pytest
from fake_sglang import FakeSGLang

from consumers.backends import SGLangBackend
from consumers.llm import TracingLLM
from consumers.proxy import TracingProxy, default_advertised_host
from consumers.toolcalls import arguments_as_objects
from schemas import Sampling

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]
TOOL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>'
# Fields that must match between a proxied call and a direct one (latency naturally differs).
SAME_FIELDS = (
    "prompt_ids",
    "response_ids",
    "finish_reason",
    "weight_version",
    "temperature",
    "top_p",
    "top_k",
    "backend",
    "model",
    "messages",
)


@pytest.fixture
async def fake(template):
    ids = template.encode(TOOL_TEXT) + [258]
    server = FakeSGLang(reply=lambda body: (ids, TOOL_TEXT))
    await server.start()
    yield server
    await server.close()


@pytest.fixture
async def engine_backend(engine_url, template):
    backend = SGLangBackend([engine_url], backoff=0.0)
    yield backend
    await backend.aclose()


@pytest.fixture
async def proxy():
    proxy = TracingProxy(host="127.0.0.1")
    await proxy.start()
    yield proxy
    await proxy.close()


def new_llm(backend, template, job_id="job-7") -> TracingLLM:
    sampling = Sampling(temperature=0.0, max_new_tokens=10)
    return TracingLLM(backend, template, sampling, "group-7", job_id, "tiny")


def client(base_url: str, api_key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)


async def test_openai_sdk_records_what_a_direct_call_records(proxy, engine_backend, template):
    via_proxy = new_llm(engine_backend, template)
    direct = new_llm(engine_backend, template, job_id="job-8")
    with proxy.register("job-7", via_proxy) as endpoint:
        assert (
            endpoint
            == proxy.endpoint_for("job-7")
            == f"http://127.0.0.1:{proxy.port}/rollouts/job-7/v1"
        )
        response = await client(endpoint).chat.completions.create(
            model="tiny", messages=QUESTION, temperature=0.0, max_tokens=8
        )
    expected = await direct.chat(QUESTION, temperature=0.0, max_tokens=8)
    (got,) = via_proxy.calls
    for name in SAME_FIELDS:
        assert getattr(got, name) == getattr(expected.call, name), name
    assert got.response_logprobs == pytest.approx(expected.call.response_logprobs, abs=1e-4)

    assert response.object == "chat.completion" and response.model == "tiny"
    assert response.id.startswith("chatcmpl-")
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.text
    assert choice.finish_reason == expected.finish_reason  # stop or length
    assert response.usage.prompt_tokens == len(got.prompt_ids)
    assert response.usage.completion_tokens == len(got.response_ids)
    assert response.usage.total_tokens == len(got.prompt_ids) + len(got.response_ids)
    assert proxy.in_flight == []  # the with-block unregistered the rollout


async def test_sync_sdk_from_a_thread(proxy, engine_backend, template):
    # The seed's agents are plain functions run in a thread pool while the proxy serves on
    # the consumer's event loop.
    llm = new_llm(engine_backend, template)
    proxy.register("job-7", llm)

    def agent(endpoint: str) -> str:
        sdk = openai.OpenAI(base_url=endpoint, api_key="unused", max_retries=0)
        first = sdk.chat.completions.create(model="tiny", messages=QUESTION)
        messages = [*QUESTION, first.choices[0].message, {"role": "user", "content": "Sure?"}]
        sdk.chat.completions.create(model="tiny", messages=messages)
        return first.choices[0].message.content

    text = await asyncio.to_thread(agent, proxy.endpoint_for("job-7"))
    proxy.unregister("job-7")
    assert len(llm.calls) == 2
    first, second = llm.calls
    assert first.messages[-1] == {"role": "assistant", "content": text}
    assert second.prompt_ids[: len(first.prompt_ids)] == first.prompt_ids


async def test_tool_calls_round_trip_through_the_sdk(proxy, fake, template):
    backend = SGLangBackend([fake.url], backoff=0.0)
    try:
        llm = TracingLLM(backend, template, Sampling(max_new_tokens=256), "g", "job-9", "tiny")
        proxy.register("job-9", llm)
        sdk = client(proxy.endpoint_for("job-9"))
        response = await sdk.chat.completions.create(model="tiny", messages=QUESTION, tools=TOOLS)
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "add"
        assert json.loads(call.function.arguments) == {"a": 2}
        assert choice.message.content is None  # OpenAI's shape for a reply that is only calls

        # The agent appends the SDK's message object and the tool result, as OpenAI agents do.
        messages = [
            *QUESTION,
            choice.message,
            {"role": "tool", "tool_call_id": call.id, "content": "2"},
        ]
        await sdk.chat.completions.create(model="tiny", messages=messages, tools=TOOLS)
        first, second = llm.calls
        assert first.finish_reason == "tool_calls"
        plain = [*QUESTION, first.messages[-1], messages[-1]]
        assert second.prompt_ids == template.encode_chat(arguments_as_objects(plain), tools=TOOLS)
    finally:
        await backend.aclose()


async def test_bearer_job_id_fallback(proxy, engine_backend, template):
    llm = new_llm(engine_backend, template)
    with proxy.register("job-7", llm):
        sdk = client(f"{proxy.base_url}/v1", api_key="job-7")
        await sdk.chat.completions.create(model="tiny", messages=QUESTION, max_tokens=4)
        models = await sdk.models.list()
        assert [m.id for m in models.data] == ["tiny"]
        with pytest.raises(openai.BadRequestError) as info:
            await client(f"{proxy.base_url}/v1", api_key="task-3").chat.completions.create(
                model="tiny", messages=QUESTION
            )
        message = info.value.body["message"]
        assert "job id" in message and "/rollouts/<job_id>/v1" in message
    assert len(llm.calls) == 1


async def test_requests_that_cannot_be_routed_get_400(proxy, engine_backend, template):
    llm = new_llm(engine_backend, template)
    url = proxy.base_url
    body = {"model": "tiny", "messages": QUESTION}
    with proxy.register("job-7", llm):
        async with aiohttp.ClientSession() as http:
            cases = {
                "no key": (f"{url}/v1/chat/completions", body, {}),
                "unknown job": (f"{url}/rollouts/job-404/v1/chat/completions", body, {}),
                "stream": (
                    f"{url}/rollouts/job-7/v1/chat/completions",
                    {**body, "stream": True},
                    {},
                ),
                "n": (f"{url}/rollouts/job-7/v1/chat/completions", {**body, "n": 3}, {}),
                "no messages": (f"{url}/rollouts/job-7/v1/chat/completions", {"model": "tiny"}, {}),
            }
            why = {}
            for name, (target, payload, headers) in cases.items():
                async with http.post(target, json=payload, headers=headers) as resp:
                    assert resp.status == 400, name
                    why[name] = (await resp.json())["error"]["message"]
            async with http.get(f"{url}/rollouts/job-404/v1/models") as resp:
                assert resp.status == 400
    assert "no API key" in why["no key"] and "/rollouts/<job_id>/v1" in why["no key"]
    assert "job-404" in why["unknown job"] and "per-rollout endpoint" in why["unknown job"]
    assert "streaming is not supported" in why["stream"]
    assert "n > 1" in why["n"]
    assert "messages" in why["no messages"]
    assert llm.calls == []
    # Once the rollout is over its endpoint is closed too.
    with pytest.raises(openai.BadRequestError, match="no rollout 'job-7' is in flight"):
        await client(proxy.endpoint_for("job-7")).chat.completions.create(
            model="tiny", messages=QUESTION
        )


async def test_backend_failures_map_to_http_errors(proxy, template):
    from fake_sglang import dead_url

    backend = SGLangBackend([dead_url()], retries=0, backoff=0.0)
    try:
        proxy.register("job-1", new_llm(backend, template, job_id="job-1"))
        with pytest.raises(openai.InternalServerError) as info:
            await client(proxy.endpoint_for("job-1")).chat.completions.create(
                model="tiny", messages=QUESTION
            )
        assert info.value.status_code == 503
        with pytest.raises(openai.BadRequestError, match="max_new_tokens must be >= 1"):
            await client(proxy.endpoint_for("job-1")).chat.completions.create(
                model="tiny", messages=QUESTION, max_tokens=0
            )
    finally:
        await backend.aclose()


async def test_advertised_host():
    assert TracingProxy(advertised_host="consumer-3.cluster").endpoint_for("j") == (
        "http://consumer-3.cluster:0/rollouts/j/v1"
    )
    assert TracingProxy(host="127.0.0.1").advertised_host == "127.0.0.1"
    default = TracingProxy().advertised_host
    assert default == default_advertised_host()
    resolved = socket.gethostbyname(socket.gethostname())
    if not resolved.startswith("127."):
        assert default == resolved
