"""The gateway's Anthropic Messages API against the real ``anthropic`` SDK: ``messages.stream``
and ``messages.create`` with tools, ``count_tokens`` and model listing, run by an endpoint agent
through a real worker and ending in a stored trajectory whose recorded messages and token ids
are what the client assembled and what the engine (a scripted SGLang fake) returned; the
secret as ``x-api-key`` or a bearer token; refusals in Anthropic's error shape."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import anthropic
import pytest
from fake_sglang import scripted, serving, tool_then_answer
from worker_env import worker_for

from agentarium.consumers.tracing.gateway import sse
from agentarium.consumers.tracing.proxy import secret_of
from agentarium.producers import TaskProducer, TrajectoryReader

CALL_TEXT = 'Adding now.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
ANSWER = "The sum of 2 and 3 is 5."
SYSTEM = "You are a careful calculator."
QUESTION = [{"role": "user", "content": "What is 2+3?"}]
TOOLS = [
    {
        "name": "add",
        "description": "Add two numbers",
        "input_schema": {
            "type": "object",
            "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        },
    }
]
SEEN: dict[str, dict] = {}


@pytest.fixture
async def fake(template):
    """The policy calls the tool, then answers once its result is in the prompt."""
    async with serving(scripted(template, tool_then_answer(CALL_TEXT, ANSWER))) as server:
        yield server


def base_url(endpoint: str) -> str:
    """The Anthropic SDK appends /v1/messages to its base URL: the endpoint without /v1."""
    return endpoint.removesuffix("/v1")


async def claude_style_agent(task: dict, endpoint: str, model: str) -> float:
    """Count the prompt, stream the first reply, run its tool, send the result, finish."""
    sdk = anthropic.AsyncAnthropic(base_url=base_url(endpoint), api_key="unused", max_retries=0)
    count = await sdk.messages.count_tokens(
        model=model, system=SYSTEM, messages=QUESTION, tools=TOOLS
    )
    raw_events = []
    async with sdk.messages.stream(
        model=model, max_tokens=128, system=SYSTEM, messages=QUESTION, tools=TOOLS
    ) as stream:
        async for event in stream:
            raw_events.append(event.type)
        first = await stream.get_final_message()
    (tool_use,) = [block for block in first.content if block.type == "tool_use"]
    result = {
        "type": "tool_result",
        "tool_use_id": tool_use.id,
        "content": str(sum(tool_use.input.values())),
    }
    messages = [
        *QUESTION,
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [result]},
    ]
    second = await sdk.messages.create(
        model=model, max_tokens=128, system=SYSTEM, messages=messages, tools=TOOLS
    )
    models = await sdk.models.list()
    SEEN[task["task_id"]] = {
        "count": count.input_tokens,
        "events": raw_events,
        "first": first,
        "second": second,
        "models": [m.id for m in models.data],
    }
    return 1.0


async def test_messages_streamed_with_tools_are_stored_token_exact(js, topology, fake, template):
    await TaskProducer(js, topology).submit("claude", [{"task_id": "t"}], run="gw")
    async with worker_for(js, "claude", claude_style_agent, [fake.url], attempts=1) as worker:
        assert (await worker.run()).ok == 1
    (trajectory,) = await TrajectoryReader(js, topology).read("gw")
    seen = SEEN["t"]
    first_call, second_call = trajectory.calls
    first, second = seen["first"], seen["second"]

    assert seen["events"][0] == "message_start" and seen["events"][-1] == "message_stop"
    for kind in (
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
    ):
        assert kind in seen["events"], kind
    # The SDK's assembly of the stream is the recorded reply.
    recorded = first_call.messages[-1]
    text, tool_use = first.content
    assert text.type == "text" and text.text == recorded["content"] == "Adding now."
    (call,) = recorded["tool_calls"]
    assert tool_use.id == call["id"] and tool_use.name == "add"
    assert tool_use.input == json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
    assert first.stop_reason == "tool_use"
    usage = first.usage
    assert usage.input_tokens + usage.cache_read_input_tokens == len(first_call.prompt_ids)
    assert usage.output_tokens == len(first_call.response_ids)
    assert first_call.response_ids == template.encode(CALL_TEXT) + template.eos_token_ids[:1]
    assert seen["count"] == len(first_call.prompt_ids)

    # The system prompt, the tool_use turn and its tool_result rendered as the chat template does.
    prompt = template.decode(second_call.prompt_ids)
    assert prompt.startswith(f"<|im_start|>system\n{SYSTEM}")
    assert "<tool_response>\n5\n</tool_response>" in prompt
    assert second.stop_reason == "end_turn"
    assert [block.type for block in second.content] == ["text"]
    assert second.content[0].text == ANSWER == second_call.messages[-1]["content"]
    assert second_call.response_ids == template.encode(ANSWER) + template.eos_token_ids[:1]
    assert seen["models"] == ["tiny"]


async def test_the_secret_as_x_api_key_or_bearer_token(gateway):
    proxy, llm, endpoint = gateway
    secret = secret_of(endpoint)
    by_key = anthropic.AsyncAnthropic(base_url=proxy.base_url, api_key=secret, max_retries=0)
    by_token = anthropic.AsyncAnthropic(base_url=proxy.base_url, auth_token=secret, max_retries=0)
    reply = await by_key.messages.create(model="tiny", max_tokens=16, messages=QUESTION)
    assert reply.content[0].text == CALL_TEXT  # no tools offered: the text as written
    assert (await by_token.models.retrieve("tiny")).id == "tiny"
    # Claude Code calls the beta route, /v1/messages?beta=true, with anthropic-beta headers.
    beta = await by_token.beta.messages.create(
        model="tiny",
        max_tokens=16,
        messages=QUESTION,
        betas=["fine-grained-tool-streaming-2025-05-14"],
    )
    assert beta.content[0].text == CALL_TEXT
    wrong = anthropic.AsyncAnthropic(
        base_url=proxy.base_url, api_key=secret[:-1] + "x", max_retries=0
    )
    with pytest.raises(anthropic.AuthenticationError) as info:
        await wrong.messages.create(model="tiny", max_tokens=16, messages=QUESTION)
    assert info.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        await wrong.models.list()
    with pytest.raises(anthropic.NotFoundError):
        await by_key.models.retrieve("claude-opus")
    with pytest.raises(anthropic.NotFoundError, match="Qwen/Qwen3-8B"):  # ids may hold a "/"
        await by_key.models.retrieve("Qwen/Qwen3-8B")
    assert len(llm.calls) == 2


async def test_what_the_messages_api_cannot_serve_is_refused(gateway):
    proxy, llm, endpoint = gateway
    sdk = anthropic.AsyncAnthropic(base_url=base_url(endpoint), api_key="unused", max_retries=0)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    cases = {
        "image": ({"messages": [{"role": "user", "content": [image]}]}, "'image' block"),
        "thinking budget": (  # the tiny model does not reason
            {"thinking": {"type": "enabled", "budget_tokens": 8}},
            "a thinking budget needs a model that reasons in <think> blocks",
        ),
        "budget over max_tokens": (
            {"thinking": {"type": "enabled", "budget_tokens": 1024}},
            "max_tokens must be greater than thinking.budget_tokens",
        ),
        "prefill": ({"messages": [*QUESTION, {"role": "assistant", "content": "The"}]}, "prefill"),
        "server tool": (
            {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
            "only custom tools",
        ),
        "forced tool": ({"tools": TOOLS, "tool_choice": {"type": "any"}}, "cannot be enforced"),
        "unknown field": ({"extra_body": {"top_a": 1}}, "'top_a' is not supported"),
    }
    for fields, why in cases.values():
        request = {"model": "tiny", "max_tokens": 16, "messages": QUESTION, **fields}
        with pytest.raises(anthropic.BadRequestError, match=why) as info:
            await sdk.messages.create(**request)
        assert info.value.body["type"] == "error"
        assert info.value.body["error"]["type"] == "invalid_request_error"
    async with aiohttp.ClientSession() as http:  # the SDK itself insists on max_tokens
        async with http.post(
            f"{endpoint}/messages", json={"model": "tiny", "messages": QUESTION}
        ) as r:
            assert r.status == 400
            assert await r.json() == {
                "type": "error",
                "error": {"type": "invalid_request_error", "message": "max_tokens: field required"},
            }
    assert llm.calls == []


async def test_a_long_call_pings_then_fails_in_the_stream(gateway, fake, monkeypatch):
    proxy, llm, endpoint = gateway
    monkeypatch.setattr(sse, "OPEN_AFTER_S", 0.0)
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.01)
    fake.gate = gate = asyncio.Event()
    body = {"model": "tiny", "max_tokens": 16, "messages": QUESTION, "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{endpoint}/messages", json=body) as response:
            assert response.status == 200
            ping = await response.content.readuntil(b"\n\n")
            assert ping == b'event: ping\ndata: {"type":"ping"}\n\n'
            gate.set()
            rest = (await response.read()).decode()
    names = [line[7:] for line in rest.splitlines() if line.startswith("event: ")]
    assert names[0] in ("ping", "message_start") and names[-1] == "message_stop"

    gate.clear()
    fake.failures = [500]
    sdk = anthropic.AsyncAnthropic(base_url=base_url(endpoint), api_key="unused", max_retries=0)
    async with sdk.messages.stream(model="tiny", max_tokens=16, messages=QUESTION) as stream:
        await fake.wait_for_requests(2)
        gate.set()
        with pytest.raises(anthropic.APIStatusError, match="overloaded_error"):
            await stream.get_final_message()
    assert len(llm.errors) == 1


def test_a_mid_conversation_system_message_stays_where_it_stands():
    """Claude Code sends ``role: system`` entries inside ``messages`` (its mid-conversation
    system beta, even with experimental betas off): each becomes a system chat message in
    place; any other role is refused with a message naming the entry."""
    from agentarium.consumers.tracing.gateway.anthropic import chat_messages
    from agentarium.consumers.tracing.gateway.errors import GatewayError

    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
        {"role": "system", "content": [{"type": "text", "text": "the user is away"}]},
        {"role": "user", "content": "still there?"},
    ]
    assert [(m["role"], m["content"]) for m in chat_messages("be brief", messages)] == [
        ("system", "be brief"),
        ("user", "hi"),
        ("assistant", "hello"),
        ("system", "the user is away"),
        ("user", "still there?"),
    ]
    with pytest.raises(GatewayError, match=r"messages\[0\]\.role"):
        chat_messages(None, [{"role": "tool", "content": "x"}])
