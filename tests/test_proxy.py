"""TracingProxy: the real OpenAI SDK against the per-rollout endpoint records what llm.chat does,
and the endpoint is closed: only the rollout's own secret (in the path, or as the API key)
opens it, and the secret is never logged, traced or stored."""

from __future__ import annotations

import asyncio
import hmac
import json
import socket

import aiohttp
import anthropic
import openai
import pytest
import structlog.testing
from fake_sglang import FakeSGLang
from worker_env import worker_for

import agentarium.consumers.tracing.proxy as proxy_module
from agentarium.consumers.backends import SGLangBackend
from agentarium.consumers.tracing.llm import TracingLLM
from agentarium.consumers.tracing.proxy import TracingProxy, default_advertised_host, secret_of
from agentarium.formats.toolcalls import arguments_as_objects
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.schemas import Sampling, encode

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


endpoints: list[str] = []


async def leaky_agent(task: dict, endpoint: str, model: str) -> float:
    """Calls through its endpoint, then (task "fails") raises quoting the endpoint URL."""
    endpoints.append(endpoint)
    sdk = client(endpoint, api_key=task["task_id"])
    await sdk.chat.completions.create(model=model, messages=QUESTION, max_tokens=4)
    if task["task_id"] == "fails":
        raise RuntimeError(f"could not parse the answer from {endpoint}/chat/completions")
    return 1.0


async def stream_bytes(js, stream: str) -> list[bytes]:
    """Every message's payload in ``stream``."""
    info = await js.stream_info(stream)
    return [
        (await js.get_msg(stream, seq)).data or b""
        for seq in range(info.state.first_seq, info.state.last_seq + 1)
        if info.state.messages
    ]


async def test_openai_sdk_records_what_a_direct_call_records(proxy, engine_backend, template):
    via_proxy = new_llm(engine_backend, template)
    direct = new_llm(engine_backend, template, job_id="job-8")
    with proxy.register("job-7", via_proxy) as endpoint:
        assert endpoint == proxy.endpoint_for("job-7")
        assert endpoint.startswith(f"http://127.0.0.1:{proxy.port}/r/") and endpoint.endswith("/v1")
        assert "job-7" not in endpoint and len(secret_of(endpoint)) >= 43
        response = await client(endpoint).chat.completions.create(
            model="tiny", messages=QUESTION, temperature=0.0, max_tokens=8
        )
    expected = await direct.chat(QUESTION, temperature=0.0, max_tokens=8)
    (got,) = via_proxy.calls
    for name in SAME_FIELDS:
        assert getattr(got, name) == getattr(expected.call, name), name
    # the same greedy request to the same engine, the second maybe from its prefix cache: sums
    # in other orders, ~1.2e-4 first order (tests/test_prefix_cache.py, tests/test_engine.py);
    # 1e-3 leaves 8x, and a call recorded from another request differs by ~0.07 or more
    assert got.response_logprobs == pytest.approx(expected.call.response_logprobs, abs=1e-3)

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


async def test_every_api_streamed_records_what_a_direct_call_records(
    proxy, engine_backend, template
):
    """The local engine behind Chat Completions, Responses and Messages, all streamed: each
    assembled text is the direct call's, each call's ids the engine's."""
    direct = new_llm(engine_backend, template, job_id="job-8")
    expected = await direct.chat(QUESTION, temperature=0.0, max_tokens=8)
    llm = new_llm(engine_backend, template)
    with proxy.register("job-7", llm) as endpoint:
        sdk = client(endpoint)
        chunks = await sdk.chat.completions.create(
            model="tiny", messages=QUESTION, temperature=0.0, max_tokens=8, stream=True
        )
        chat_text = "".join([c.choices[0].delta.content or "" async for c in chunks])
        events = await sdk.responses.create(
            model="tiny", input=QUESTION, temperature=0.0, max_output_tokens=8, stream=True
        )
        kinds = [(e.type, getattr(e, "delta", "")) async for e in events]
        responses_text = "".join(d for kind, d in kinds if kind == "response.output_text.delta")
        claude = anthropic.AsyncAnthropic(
            base_url=endpoint.removesuffix("/v1"), api_key="unused", max_retries=0
        )
        async with claude.messages.stream(
            model="tiny", max_tokens=8, messages=QUESTION, extra_body={"temperature": 0.0}
        ) as stream:
            anthropic_text = "".join([text async for text in stream.text_stream])
    assert len(llm.calls) == 3
    for call, text in zip(llm.calls, (chat_text, responses_text, anthropic_text), strict=True):
        assert call.prompt_ids == expected.call.prompt_ids
        assert call.response_ids == expected.call.response_ids
        assert text == expected.text == template.decode(call.response_ids, skip_special_tokens=True)


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


async def test_the_secret_opens_the_rollout_in_the_path_or_as_the_api_key(proxy, fake, template):
    backend = SGLangBackend([fake.url], backoff=0.0)
    llm = TracingLLM(backend, template, Sampling(max_new_tokens=4), "g", "job-7", "tiny")
    try:
        with proxy.register("job-7", llm) as endpoint:
            secret = secret_of(endpoint)
            # The path form ignores whatever key the agent sends (the seed passes its task id).
            await client(endpoint, api_key="task-3").chat.completions.create(
                model="tiny", messages=QUESTION
            )
            # The key form: the same secret as the OpenAI api_key, on the plain /v1 path.
            sdk = client(f"{proxy.base_url}/v1", api_key=secret)
            await sdk.chat.completions.create(model="tiny", messages=QUESTION)
            assert [m.id for m in (await sdk.models.list()).data] == ["tiny"]
    finally:
        await backend.aclose()
    assert len(llm.calls) == 2


async def test_a_guessed_job_id_or_a_wrong_secret_is_refused_alike(proxy, fake, template):
    backend = SGLangBackend([fake.url], backoff=0.0)
    llm = TracingLLM(backend, template, Sampling(max_new_tokens=4), "g", "job-7", "tiny")
    url = proxy.base_url
    body = {"model": "tiny", "messages": QUESTION}
    try:
        with proxy.register("job-7", llm) as endpoint:
            secret = secret_of(endpoint)
            wrong = secret[:-1] + ("A" if secret[-1] != "A" else "B")
            refused = {
                "no key": (f"{url}/v1/chat/completions", {}),
                "job id as key": (f"{url}/v1/chat/completions", {"Authorization": "Bearer job-7"}),
                "job id in path": (f"{url}/r/job-7/v1/chat/completions", {}),
                "unknown job in path": (f"{url}/r/job-404/v1/chat/completions", {}),
                "wrong secret": (f"{url}/r/{wrong}/v1/chat/completions", {}),
                "wrong key": (f"{url}/v1/chat/completions", {"Authorization": f"Bearer {wrong}"}),
            }
            answers = {}
            async with aiohttp.ClientSession() as http:
                for name, (target, headers) in refused.items():
                    async with http.post(target, json=body, headers=headers) as resp:
                        answers[name] = (resp.status, await resp.text())
                # The old form with a job id in the path opens nothing either.
                async with http.post(f"{url}/rollouts/job-7/v1/chat/completions", json=body) as r:
                    assert r.status == 404
                async with http.get(f"{url}/r/{wrong}/v1/models") as resp:
                    assert resp.status == 401
        # Once the rollout is over its endpoint is closed, and says so the same way.
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{endpoint}/chat/completions", json=body) as resp:
                answers["finished rollout"] = (resp.status, await resp.text())
    finally:
        await backend.aclose()
    assert llm.calls == [] and fake.count == 0
    # One answer for all of them: nothing tells whether job-7 exists or ever ran.
    assert {status for status, _ in answers.values()} == {401}
    assert len({text for _, text in answers.values()}) == 1, answers
    message = json.loads(answers["no key"][1])["error"]["message"]
    assert "/r/<secret>/v1" in message and "job-7" not in message
    assert proxy.rejected == len(answers) + 1


async def test_secrets_are_compared_in_constant_time(proxy, fake, template, monkeypatch):
    compared: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a, b):
        compared.append((a, b))
        return real(a, b)

    monkeypatch.setattr(proxy_module.hmac, "compare_digest", spy)
    backend = SGLangBackend([fake.url], backoff=0.0)
    llm = TracingLLM(backend, template, Sampling(max_new_tokens=4), "g", "job-7", "tiny")
    try:
        with proxy.register("job-7", llm) as endpoint:
            secret = secret_of(endpoint).encode()
            await client(endpoint).chat.completions.create(model="tiny", messages=QUESTION)
            await client(f"{proxy.base_url}/v1", api_key=secret.decode()).models.list()
            with pytest.raises(openai.AuthenticationError):
                await client(f"{proxy.base_url}/v1", api_key="guess").models.list()
    finally:
        await backend.aclose()
    assert compared[:2] == [(secret, secret), (secret, secret)]
    assert len(compared) == 3 and compared[2][1] == b"guess"  # a miss is compared too


async def test_the_secret_is_never_logged_traced_or_stored(js, topology, fake, span_exporter):
    """An endpoint agent whose calls go through the proxy and whose failure message quotes its
    endpoint URL: its secret appears in no log line, span, trajectory or dead letter."""
    endpoints.clear()
    await TaskProducer(js, topology).submit(
        "leaky", [{"task_id": "fine"}, {"task_id": "fails"}], run="closed"
    )
    with structlog.testing.capture_logs() as logs:
        async with worker_for(js, "leaky", leaky_agent, [fake.url], attempts=1) as worker:
            counters = await worker.run()
    assert counters.ok == 1 and counters.dead_lettered == 1 and counters.errors == 1
    secrets_seen = [secret_of(e) for e in endpoints]
    assert len(secrets_seen) == 2 and all(len(s) >= 43 for s in secrets_seen)
    trajectories = await TrajectoryReader(js, topology).read("closed")
    failed = next(t for t in trajectories if t.task_id == "fails")
    assert "***" in failed.error and "/r/***/v1" in failed.error  # the URL is kept, masked
    stored = [encode(t) for t in trajectories]
    letters = await stream_bytes(js, topology.dead_stream)
    spans = [span.to_json() for span in span_exporter.get_finished_spans()]
    assert any("exception" in s for s in spans)  # the failure is on its span...
    for secret in secrets_seen:
        assert secret not in repr(logs)
        assert all(secret.encode() not in raw for raw in [*stored, *letters])
        assert all(secret not in s for s in spans)  # ...without the secret


async def test_requests_the_proxy_cannot_serve_get_400(proxy, fake, template):
    backend = SGLangBackend([fake.url], backoff=0.0)
    llm = TracingLLM(backend, template, Sampling(max_new_tokens=4), "g", "job-7", "tiny")
    body = {"model": "tiny", "messages": QUESTION}
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    try:
        with proxy.register("job-7", llm) as endpoint:
            cases = {
                "n": {**body, "n": 3},
                "no messages": {"model": "tiny"},
                "image": {**body, "messages": [{"role": "user", "content": [image]}]},
                "unknown field": {**body, "guided_grammar": "root ::= x"},
                "forced tool": {**body, "tools": TOOLS, "tool_choice": "required"},
                "logprobs": {**body, "logprobs": True},
            }
            why = {}
            async with aiohttp.ClientSession() as http:
                for name, payload in cases.items():
                    async with http.post(f"{endpoint}/chat/completions", json=payload) as resp:
                        assert resp.status == 400, name
                        why[name] = (await resp.json())["error"]["message"]
    finally:
        await backend.aclose()
    assert "n > 1" in why["n"]
    assert "messages" in why["no messages"]
    assert "'image_url' part" in why["image"] and "text model" in why["image"]
    assert "'guided_grammar' is not supported" in why["unknown field"]
    assert "cannot be enforced" in why["forced tool"]
    assert "logprobs" in why["logprobs"]
    assert llm.calls == [] and fake.count == 0


async def test_backend_failures_map_to_http_errors(proxy, template):
    from fake_sglang import dead_url

    backend = SGLangBackend([dead_url()], retries=0, backoff=0.0)
    try:
        with proxy.register("job-1", new_llm(backend, template, job_id="job-1")) as endpoint:
            with pytest.raises(openai.InternalServerError) as info:
                await client(endpoint).chat.completions.create(model="tiny", messages=QUESTION)
            assert info.value.status_code == 503
            for stream in (False, True):  # refused before a stream opens: a plain 400
                with pytest.raises(openai.BadRequestError, match="max_new_tokens must be >= 1"):
                    await client(endpoint).chat.completions.create(
                        model="tiny", messages=QUESTION, max_tokens=0, stream=stream
                    )
    finally:
        await backend.aclose()


async def test_advertised_host_and_the_loopback_default():
    advertised = TracingProxy(advertised_host="consumer-3.cluster")
    with advertised.register("j", None):  # type: ignore[arg-type]
        assert advertised.endpoint_for("j").startswith("http://consumer-3.cluster:0/r/")
    assert TracingProxy().host == "127.0.0.1"  # single host: agents on this machine only
    assert TracingProxy(host="127.0.0.1").advertised_host == "127.0.0.1"
    default = TracingProxy(host="0.0.0.0").advertised_host
    assert default == default_advertised_host()
    resolved = socket.gethostbyname(socket.gethostname())
    if not resolved.startswith("127."):
        assert default == resolved
