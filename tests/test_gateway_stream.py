"""Replies stream through the gateway as they are generated (consumers/tracing/gateway/sse.py),
from the real local engine (in this process, so a test can see what it is doing) through the
consumer's SGLangBackend and tracing client, to the official openai and anthropic SDKs:

- each SDK has its first delta while the engine is still generating the call's tokens, and the
  stream it assembles equals the recorded message, which is the same token-exact record as an
  unstreamed call's;
- a client that goes away mid-stream stops the engine's work on the call within a second, and
  the call is recorded as aborted with the tokens it had, never as finished.

The tiny model is random; greedy, it writes 1,500 tokens without an end-of-sequence token, about
two seconds of work on this machine: long enough that "still generating" and "stopped early"
are facts about the engine, not about timing (a reply that ended by itself would be recorded
as finished, not aborted, and fail the disconnect test).
"""

from __future__ import annotations

import asyncio

import anthropic
import openai
import pytest

from agentarium.consumers.backends import SGLangBackend
from agentarium.consumers.tracing.llm import TracingLLM
from agentarium.consumers.tracing.proxy import TracingProxy
from agentarium.inference.engine import LocalEngine, start_server
from agentarium.schemas import Sampling

LONG = 1500  # tokens the greedy tiny model writes before its context would run out
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture
async def stack(tiny_dir, template):
    """(engine, llm, endpoint): the real engine, a rollout's tracing client on it through the
    SGLang backend, and that rollout's gateway endpoint."""
    engine = LocalEngine(tiny_dir, threads=1, max_batch=8)
    running = await start_server(engine, "127.0.0.1", 0)
    backend = SGLangBackend([running.url], retries=0, backoff=0.0)
    proxy = TracingProxy(host="127.0.0.1")
    await proxy.start()
    llm = TracingLLM(backend, template, Sampling(max_new_tokens=LONG), "g", "job-1", "tiny")
    try:
        with proxy.register("job-1", llm) as endpoint:
            yield engine, llm, endpoint
    finally:
        await proxy.close()
        await backend.aclose()
        await running.close()


def running_rows(engine: LocalEngine) -> int:
    return engine.scheduler.num_running + engine.scheduler.num_waiting


async def stopped_within(engine: LocalEngine, seconds: float) -> None:
    await asyncio.wait_for(engine.scheduler.wait_for(lambda: running_rows(engine) == 0), seconds)


async def test_the_openai_sdk_gets_deltas_while_the_engine_generates(stack):
    engine, llm, endpoint = stack
    sdk = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)
    stream = await sdk.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=200, temperature=0, stream=True
    )
    content, generating_at_first = "", None
    async for chunk in stream:
        text = chunk.choices[0].delta.content if chunk.choices else None
        if text and generating_at_first is None:
            generating_at_first = running_rows(engine) == 1
        content += text or ""
    assert generating_at_first is True
    (call,) = llm.calls
    assert call.finish_reason == "length" and len(call.response_ids) == 200
    assert content == call.messages[-1]["content"]  # the stream is the recorded message

    # the same call unstreamed: the same tokens, log-probs and message (greedy, the same engine)
    whole = await sdk.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=200, temperature=0
    )
    again = llm.calls[1]
    assert again.response_ids == call.response_ids and again.prompt_ids == call.prompt_ids
    # the second call's prompt comes from the prefix cache, whose log-probs are within 1e-4 of
    # a whole prefill's (docs/design.md, tests/test_prefix_cache.py)
    assert again.response_logprobs == pytest.approx(call.response_logprobs, abs=1e-4)
    assert whole.choices[0].message.content == content


async def test_the_openai_sdk_gets_response_deltas_while_the_engine_generates(stack):
    engine, llm, endpoint = stack
    sdk = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)
    stream = await sdk.responses.create(
        model="tiny", input=QUESTION, max_output_tokens=200, temperature=0, stream=True
    )
    text, generating_at_first, final = "", None, None
    async for event in stream:
        if event.type == "response.output_text.delta":
            if generating_at_first is None:
                generating_at_first = running_rows(engine) == 1
            text += event.delta
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert generating_at_first is True
    (call,) = llm.calls
    assert final is not None and final.output_text == text == call.messages[-1]["content"]
    assert final.status == "incomplete"  # cut at max_output_tokens


async def test_the_anthropic_sdk_gets_deltas_while_the_engine_generates(stack):
    engine, llm, endpoint = stack
    sdk = anthropic.AsyncAnthropic(base_url=endpoint.removesuffix("/v1"), api_key="unused")
    generating_at_first = None
    # this SDK has no temperature parameter (Anthropic's newer models take none): the body has
    async with sdk.messages.stream(
        model="tiny", messages=QUESTION, max_tokens=200, extra_body={"temperature": 0}
    ) as stream:
        async for text in stream.text_stream:
            if text and generating_at_first is None:
                generating_at_first = running_rows(engine) == 1
        message = await stream.get_final_message()
    assert generating_at_first is True
    (call,) = llm.calls
    assert message.content[0].text == call.messages[-1]["content"]
    assert message.usage.output_tokens == len(call.response_ids) == 200
    assert message.stop_reason == "max_tokens"


async def test_a_stop_string_met_mid_stream_is_never_sent(stack, template):
    """The reply stops at a stop string that spans two tokens: the first token's text, which
    might have been the reply's, is held back, never sent and then taken back. What was
    streamed is the recorded message."""
    _, llm, endpoint = stack
    await llm.chat(QUESTION, temperature=0, max_tokens=60)
    ids = llm.calls[-1].response_ids
    text = llm.calls[-1].messages[-1]["content"]

    def plain(token: int) -> str:
        piece = template.decode([token])
        return piece if piece.isascii() and piece.isprintable() else ""

    first, second = next(
        (a, b) for a, b in zip(ids, ids[1:], strict=False) if plain(a) and plain(b)
    )
    stop = plain(first) + plain(second)[:4]  # e.g. "t" + "</to" of "</tool_response>"
    sdk = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)
    stream = await sdk.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=60, temperature=0, stop=[stop], stream=True
    )
    streamed = "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])
    assert streamed == text[: text.index(stop)] == llm.calls[-1].messages[-1]["content"]
    assert llm.calls[-1].finish_reason == "stop"


async def test_a_client_that_goes_away_stops_the_engine_within_a_second(stack):
    engine, llm, endpoint = stack
    sdk = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)
    stream = await sdk.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=LONG, temperature=0, stream=True
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            break
    assert running_rows(engine) == 1
    await stream.close()  # the harness cancels the call
    await stopped_within(engine, 1.0)
    # recorded as the cancellation unwound the tracing client, before the engine heard of it
    (call,) = llm.calls
    assert call.finish_reason == "abort" and 0 < len(call.response_ids) < LONG
    assert len(call.response_logprobs) == len(call.response_ids)

    # the engine serves the next call as before
    reply = await sdk.chat.completions.create(
        model="tiny", messages=QUESTION, max_tokens=8, temperature=0
    )
    assert reply.choices[0].finish_reason == "length"
