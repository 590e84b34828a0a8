"""The gateway's OpenAI APIs against the real ``openai`` SDK: Chat Completions streamed (tool-call
deltas, include_usage) and the Responses API (streamed events, function calls,
previous_response_id), each run by an endpoint agent through a real worker, ending in a stored
trajectory whose recorded messages and token ids are what the client assembled and what the
engine (a fake following SGLang's shapes, scripted to call a tool then answer) returned."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from agentlib import add_tool
from fake_sglang import scripted, serving, tool_then_answer
from worker_env import worker_for

from agentarium.consumers.tracing.gateway import sse
from agentarium.producers import TaskProducer, TrajectoryReader

CALL_TEXT = (
    'I will add them.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
)
ANSWER = "The sum of 2 and 3 is 5."
QUESTION = "What is 2+3?"
TOOLS = [add_tool()]
RESPONSES_TOOLS = [{"type": "function", **TOOLS[0]["function"]}]
SEEN: dict[str, dict] = {}  # what each agent's client assembled, by task id


@pytest.fixture
async def fake(template):
    """The policy calls the tool, then answers once its result is in the prompt."""
    async with serving(scripted(template, tool_then_answer(CALL_TEXT, ANSWER))) as server:
        yield server


def client(endpoint: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)


def engine_ids(template, text: str) -> list[int]:
    """The ids the scripted engine returned for ``text`` (its tokens and the EOS)."""
    return template.encode(text) + template.eos_token_ids[:1]


async def run_agent(js, topology, agent, fake, tasks: list[dict]):
    SEEN.clear()
    await TaskProducer(js, topology).submit("gw", tasks, run="gw")
    async with worker_for(js, "gw", agent, [fake.url], attempts=1) as worker:
        counters = await worker.run()
    assert counters.ok == len(tasks), counters
    trajectories = await TrajectoryReader(js, topology).read("gw")
    return {t.task_id: t for t in trajectories}


async def streamed_chat_agent(task: dict, endpoint: str, model: str) -> float:
    """A harness's loop: stream each reply, assemble it from the chunks, run the tool calls."""
    sdk = client(endpoint)
    messages: list[dict] = [{"role": "user", "content": QUESTION}]
    turns = []
    while len(turns) < 3:
        stream = await sdk.chat.completions.create(
            model=model,
            messages=messages,
            tools=TOOLS,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
        content, calls, finish = "", {}, None
        for chunk in chunks[:-1]:
            (choice,) = chunk.choices
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"type": "function", "function": {}})
                if delta.id:
                    call["id"] = delta.id
                function = call["function"]
                if delta.function.name:
                    function["name"] = delta.function.name
                function["arguments"] = function.get("arguments", "") + (
                    delta.function.arguments or ""
                )
            finish = choice.finish_reason or finish
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = [calls[i] for i in sorted(calls)]
        turns.append(
            {
                "message": message,
                "finish": finish,
                "usage": chunks[-1].usage,
                "first": chunks[0].choices[0].delta.role,
                "usage_chunk_choices": chunks[-1].choices,
                "ids": {c.id for c in chunks},
            }
        )
        messages.append(message)
        if not calls:
            break
        for call in message["tool_calls"]:
            arguments = json.loads(call["function"]["arguments"])
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": call["id"],
                    "content": str(sum(arguments.values())),
                }
            )
    SEEN[task["task_id"]] = {"turns": turns}
    return 1.0


async def test_streamed_chat_with_tool_calls_is_stored_token_exact(js, topology, fake, template):
    (trajectory,) = (
        await run_agent(js, topology, streamed_chat_agent, fake, [{"task_id": "t"}])
    ).values()
    turns = SEEN["t"]["turns"]
    assert [turn["finish"] for turn in turns] == ["tool_calls", "stop"]
    assert len(trajectory.calls) == 2
    for turn, call, text in zip(turns, trajectory.calls, (CALL_TEXT, ANSWER), strict=True):
        assert turn["first"] == "assistant" and len(turn["ids"]) == 1  # one id per stream
        assert turn["usage_chunk_choices"] == []  # include_usage: a last chunk of usage only
        assert turn["usage"].prompt_tokens == len(call.prompt_ids)
        assert turn["usage"].completion_tokens == len(call.response_ids)
        # What the client assembled is the recorded reply, and its ids are the engine's.
        assert turn["message"] == call.messages[-1]
        assert call.response_ids == engine_ids(template, text)
        assert template.decode(call.response_ids, skip_special_tokens=True) == text
    (request_1, request_2) = fake.requests
    assert [request_1["input_ids"], request_2["input_ids"]] == [
        c.prompt_ids for c in trajectory.calls
    ]
    first = turns[0]["message"]
    assert first["content"] == "I will add them."
    (tool_call,) = first["tool_calls"]
    assert tool_call["function"] == {"name": "add", "arguments": '{"a": 2, "b": 3}'}
    # The tool's result reached the second prompt.
    assert "<tool_response>\n5\n</tool_response>" in template.decode(trajectory.calls[1].prompt_ids)


async def sdk_stream_agent(task: dict, endpoint: str, model: str) -> float:
    """The SDK's own accumulator (``chat.completions.stream``) over the gateway's chunks."""
    async with client(endpoint).chat.completions.stream(
        model=model, messages=[{"role": "user", "content": QUESTION}], tools=TOOLS
    ) as stream:
        final = await stream.get_final_completion()
    SEEN[task["task_id"]] = {"final": final}
    return 1.0


async def test_the_sdks_stream_accumulator_rebuilds_the_recorded_reply(js, topology, fake):
    (trajectory,) = (
        await run_agent(js, topology, sdk_stream_agent, fake, [{"task_id": "t"}])
    ).values()
    choice = SEEN["t"]["final"].choices[0]
    (call,) = trajectory.calls
    recorded = call.messages[-1]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == recorded["content"]
    (tool_call,) = choice.message.tool_calls
    assert tool_call.id == recorded["tool_calls"][0]["id"]
    assert tool_call.function.arguments == recorded["tool_calls"][0]["function"]["arguments"]


async def responses_agent(task: dict, endpoint: str, model: str) -> float:
    """Streamed first response; the tool's output sent with previous_response_id, or (task
    "stateless") the whole conversation sent back as input items, as store=false clients do."""
    sdk = client(endpoint)
    stream = await sdk.responses.create(
        model=model, instructions="Be brief.", input=QUESTION, tools=RESPONSES_TOOLS, stream=True
    )
    events = [event async for event in stream]
    first = events[-1].response
    (call,) = [item for item in first.output if item.type == "function_call"]
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    if task["task_id"] == "stateless":
        history = [{"role": "user", "content": QUESTION}]
        history += [item.model_dump(exclude_none=True) for item in first.output]
        second = await sdk.responses.create(
            model=model,
            instructions="Be brief.",
            input=[*history, output],
            tools=RESPONSES_TOOLS,
            store=False,
        )
    else:
        second = await sdk.responses.create(
            model=model,
            instructions="Be brief.",
            previous_response_id=first.id,
            input=[output],
            tools=RESPONSES_TOOLS,
        )
    SEEN[task["task_id"]] = {"events": events, "first": first, "second": second}
    return 1.0


async def test_responses_api_streamed_and_continued_is_stored_token_exact(
    js, topology, fake, template
):
    tasks = [{"task_id": "chained"}, {"task_id": "stateless"}]
    trajectories = await run_agent(js, topology, responses_agent, fake, tasks)
    chained, stateless = SEEN["chained"], SEEN["stateless"]
    events = chained["events"]
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] == "response.completed"
    assert [event.sequence_number for event in events] == list(range(len(events)))
    for kind in (
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ):
        assert kind in kinds, kind
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    arguments = "".join(
        e.delta for e in events if e.type == "response.function_call_arguments.delta"
    )

    first_call, second_call = trajectories["chained"].calls
    recorded = first_call.messages[-1]
    assert text == recorded["content"] == chained["first"].output_text == "I will add them."
    (tool_call,) = recorded["tool_calls"]
    (item,) = [i for i in chained["first"].output if i.type == "function_call"]
    assert arguments == item.arguments == tool_call["function"]["arguments"]
    assert item.call_id == tool_call["id"] and item.name == "add"
    assert chained["first"].usage.input_tokens == len(first_call.prompt_ids)
    assert chained["first"].usage.output_tokens == len(first_call.response_ids)
    assert first_call.response_ids == engine_ids(template, CALL_TEXT)

    second = chained["second"]
    assert second.status == "completed" and second.output_text == ANSWER
    assert second.previous_response_id == chained["first"].id
    assert second_call.messages[-1] == {"role": "assistant", "content": ANSWER}
    assert second_call.response_ids == engine_ids(template, ANSWER)
    # The instructions are the system prompt of each call; the chained conversation is the
    # one sent back whole: the same prompt, token for token.
    assert template.decode(first_call.prompt_ids).count("Be brief.") == 1
    assert second_call.prompt_ids == trajectories["stateless"].calls[1].prompt_ids
    assert stateless["second"].output_text == ANSWER


async def test_previous_response_id_is_the_rollouts_own(js, topology, fake):
    """A response id from another rollout (or one never stored) is refused in OpenAI's shape."""
    SEEN.clear()
    ids: list[str] = []

    async def agent(task: dict, endpoint: str, model: str) -> float:
        sdk = client(endpoint)
        if ids:
            with pytest.raises(openai.BadRequestError) as info:
                await sdk.responses.create(model=model, input="more", previous_response_id=ids[0])
            SEEN["refused"] = info.value.body
        else:
            ids.append((await sdk.responses.create(model=model, input=QUESTION, store=False)).id)
        return 1.0

    await TaskProducer(js, topology).submit("gw", [{"task_id": "a"}, {"task_id": "b"}], run="gw")
    async with worker_for(js, "gw", agent, [fake.url], attempts=1, concurrency=1) as worker:
        assert (await worker.run()).ok == 2
    assert SEEN["refused"]["code"] == "previous_response_not_found"
    assert "kept only within the rollout" in SEEN["refused"]["message"]


async def test_what_the_responses_api_cannot_serve_is_refused(gateway):
    proxy, llm, endpoint = gateway
    sdk = client(endpoint)
    cases = {
        "web_search tool": ({"tools": [{"type": "web_search"}]}, "only function tools"),
        "encrypted reasoning item": (
            {
                "input": [
                    {"type": "reasoning", "id": "rs_1", "summary": [], "encrypted_content": "gAAAA"}
                ]
            },
            "encrypted reasoning",
        ),
        "image": (
            {
                "input": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "input_image", "image_url": "data:image/png;base64,AA"}
                        ],
                    }
                ]
            },
            "text model",
        ),
        "background": ({"background": True}, "background is not supported"),
        "reasoning effort": ({"reasoning": {"effort": "high"}}, "cannot be turned on"),
        "unknown effort": ({"reasoning": {"effort": "max"}}, "is not one of none"),
        "forced tool": (
            {"tools": RESPONSES_TOOLS, "tool_choice": "required"},
            "cannot be enforced",
        ),
        "unknown field": ({"extra_body": {"guided_json": {}}}, "'guided_json' is not supported"),
    }
    for fields, why in cases.values():
        request = {"model": "tiny", "input": QUESTION, **fields}
        with pytest.raises(openai.BadRequestError, match=why) as info:
            await sdk.responses.create(**request)
        assert info.value.body["type"] == "invalid_request_error"
    assert llm.calls == []


async def test_a_long_call_keeps_the_stream_alive_then_fails_in_the_stream(
    gateway, fake, monkeypatch
):
    """A call still running opens the stream and sends keep-alives; a backend failure then comes
    as the API's in-stream error, which the SDKs raise (chat) or report (response.failed)."""
    proxy, llm, endpoint = gateway
    monkeypatch.setattr(sse, "OPEN_AFTER_S", 0.0)
    monkeypatch.setattr(sse, "KEEPALIVE_S", 0.01)
    fake.gate = gate = asyncio.Event()
    body = {"model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "stream": True}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{endpoint}/chat/completions", json=body) as response:
            assert response.status == 200
            assert await response.content.readuntil(b"\n\n") == b": keep-alive\n\n"
            gate.set()
            rest = (await response.read()).decode()
    data = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    # No tools offered: the text is the answer as written.
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == CALL_TEXT

    gate.clear()
    fake.failures = [500, 500]
    sdk = client(endpoint)
    stream = await sdk.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": QUESTION}], stream=True
    )
    await fake.wait_for_requests(2)
    gate.set()
    with pytest.raises(openai.APIError, match="failed"):
        [chunk async for chunk in stream]
    gate.clear()
    stream = await sdk.responses.create(model="tiny", input=QUESTION, stream=True)
    await fake.wait_for_requests(3)
    gate.set()
    events = [event async for event in stream]
    assert [e.type for e in events] == ["response.created", "response.failed"]
    assert (
        events[-1].response.status == "failed" and events[-1].response.error.code == "server_error"
    )
    assert len(llm.errors) == 2
