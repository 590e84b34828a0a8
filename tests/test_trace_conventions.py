"""Traces that LLM tooling understands: chat spans in the OpenTelemetry GenAI conventions,
prompts and replies only when the user opts in, an OpenInference kind on every span, and
train steps linked to the very rollout spans they trained on."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from aiohttp import web
from fake_sglang import FakeSGLang, dead_url
from opentelemetry.trace import SpanKind, StatusCode
from worker_env import worker_for

from agentarium.consumers.backends import CrossSamplingBackend, SGLangBackend
from agentarium.consumers.backends.openai_compat import OpenAICompatBackend
from agentarium.consumers.errors import BackendUnavailable, BadRequest
from agentarium.consumers.tracing.genai import CAPTURE_CONTENT_ENV
from agentarium.consumers.tracing.llm import TracingLLM
from agentarium.consumers.tracing.proxy import TracingProxy
from agentarium.producers import TaskProducer
from agentarium.schemas import Sampling
from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.loop import Trainer

torch.set_num_threads(1)
KIND = "openinference.span.kind"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers",
            "parameters": {"type": "object", "properties": {"a": {"type": "number"}}},
        },
    }
]
TOOL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
CONVERSATION = [
    {"role": "system", "content": "You add numbers."},
    {"role": "user", "content": "What is 2+3?"},
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"id": "call-1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "5"},
]


@pytest.fixture
def capture(monkeypatch):
    """Set the content switch (or remove it) for the LLM clients created afterwards."""

    def switch(value: str | None) -> None:
        if value is None:
            monkeypatch.delenv(CAPTURE_CONTENT_ENV, raising=False)
        else:
            monkeypatch.setenv(CAPTURE_CONTENT_ENV, value)

    switch(None)
    return switch


def chat_spans(exporter, name: str = "chat tiny") -> list:
    return [s for s in exporter.get_finished_spans() if s.name == name]


def assert_conforms(messages: list, *, output: bool) -> None:
    """What the conventions' messages JSON schemas require (viewers drop a list with one
    malformed message): a role and parts, each part with its type's required fields."""
    required = {
        "text": {"content"},
        "reasoning": {"content"},
        "tool_call": {"name"},
        "tool_call_response": {"response"},
        "uri": {"modality", "uri"},
    }
    for message in messages:
        assert isinstance(message["role"], str) and isinstance(message["parts"], list)
        if output:
            assert isinstance(message["finish_reason"], str)
        for part in message["parts"]:
            assert required.get(part["type"], set()) <= set(part), part


async def test_chat_span_carries_the_genai_attributes(replying, template, span_exporter, capture):
    fake = await replying("five", cached_tokens=5)
    backend = SGLangBackend([fake.url], backoff=0.0)
    try:
        llm = TracingLLM(
            backend,
            template,
            Sampling(temperature=0.7, top_p=0.9, top_k=20, max_new_tokens=12),
            model_name="tiny",
        )
        result = await llm.chat([{"role": "user", "content": "2+3?"}], seed=7)
    finally:
        await backend.aclose()
    (span,) = chat_spans(span_exporter)
    attrs = span.attributes
    assert span.kind is SpanKind.CLIENT and span.status.status_code is StatusCode.UNSET
    assert {k: attrs[k] for k in attrs if k.startswith(("gen_ai.", KIND))} == {
        KIND: "LLM",
        "gen_ai.operation.name": "chat",
        "gen_ai.provider.name": "sglang",
        "gen_ai.request.model": "tiny",
        "gen_ai.request.temperature": 0.7,
        "gen_ai.request.top_p": 0.9,
        "gen_ai.request.top_k": 20.0,
        "gen_ai.request.max_tokens": 12,
        "gen_ai.request.seed": 7,
        "gen_ai.response.id": fake.requests[0]["rid"],  # the engine's own request id
        "gen_ai.response.model": "tiny",
        "gen_ai.response.finish_reasons": ("stop",),
        "gen_ai.usage.input_tokens": len(result.call.prompt_ids),
        "gen_ai.usage.output_tokens": len(result.call.response_ids),
        "gen_ai.usage.cache_read.input_tokens": 5,
    }  # and no prompt or reply: content capture is off by default
    assert "error.type" not in attrs
    assert attrs["server.address"] == "127.0.0.1" and attrs["agentarium.weight_version"]


@pytest.mark.parametrize("switch", [None, "false", "true"])
async def test_messages_are_on_the_span_only_when_the_user_opts_in(
    replying, template, span_exporter, capture, switch
):
    capture(switch)
    fake = await replying(TOOL_TEXT)
    backend = SGLangBackend([fake.url], backoff=0.0)
    try:
        llm = TracingLLM(backend, template, Sampling(max_new_tokens=64), model_name="tiny")
        result = await llm.chat(CONVERSATION, tools=TOOLS)
    finally:
        await backend.aclose()
    (span,) = chat_spans(span_exporter)
    attrs = span.attributes
    content = ("gen_ai.input.messages", "gen_ai.output.messages", "gen_ai.tool.definitions")
    if switch != "true":
        assert not set(content) & set(attrs)
        return
    sent = json.loads(attrs["gen_ai.input.messages"])
    assert_conforms(sent, output=False)
    assert [m["role"] for m in sent] == ["system", "user", "assistant", "tool"]
    assert sent[1]["parts"] == [{"type": "text", "content": "What is 2+3?"}]
    assert sent[2]["parts"] == [
        {"type": "tool_call", "id": "call-1", "name": "add", "arguments": {}}
    ]
    assert sent[3]["parts"] == [{"type": "tool_call_response", "id": "call-1", "response": "5"}]
    (reply,) = json.loads(attrs["gen_ai.output.messages"])
    assert_conforms([reply], output=True)
    assert reply["role"] == "assistant" and reply["finish_reason"] == "tool_call"
    (call,) = reply["parts"]
    assert call["type"] == "tool_call" and call["id"] == result.tool_calls[0]["id"]
    assert (call["name"], call["arguments"]) == ("add", {"a": 2, "b": 3})
    assert json.loads(attrs["gen_ai.tool.definitions"]) == [
        {
            "type": "function",
            "name": "add",
            **{k: TOOLS[0]["function"][k] for k in ("description", "parameters")},
        }
    ]


async def test_calls_through_the_proxy_show_what_the_sdk_sent(
    replying, template, span_exporter, capture
):
    capture("true")
    fake = await replying("five")
    backend = SGLangBackend([fake.url], backoff=0.0)
    proxy = TracingProxy(host="127.0.0.1")
    await proxy.start()
    try:
        llm = TracingLLM(backend, template, Sampling(), rid_prefix="job-9", model_name="tiny")
        with proxy.register("job-9", llm):
            sdk = openai.AsyncOpenAI(base_url=proxy.endpoint_for("job-9"), api_key="-")
            reply = await sdk.chat.completions.create(
                model="tiny",
                messages=[{"role": "user", "content": "2+3?"}],
                temperature=0.5,
                max_tokens=8,
                seed=3,
            )
            await sdk.close()
    finally:
        await proxy.close()
        await backend.aclose()
    (span,) = chat_spans(span_exporter)
    attrs = span.attributes
    assert (attrs["gen_ai.request.temperature"], attrs["gen_ai.request.max_tokens"]) == (0.5, 8)
    assert attrs["gen_ai.request.seed"] == 3
    assert json.loads(attrs["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "2+3?"}]}
    ]
    (answer,) = json.loads(attrs["gen_ai.output.messages"])
    assert answer["parts"] == [{"type": "text", "content": reply.choices[0].message.content}]


@pytest.fixture
async def hosted():
    """A hosted OpenAI-compatible API: it names its model version and reports cached tokens."""

    async def completions(request: web.Request) -> web.Response:
        return web.json_response(
            {
                "id": "chatcmpl-42",
                "model": "gpt-x-0613",
                "choices": [
                    {"message": {"role": "assistant", "content": "5"}, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": 9,
                    "completion_tokens": 1,
                    "prompt_tokens_details": {"cached_tokens": 4},
                },
            }
        )

    app = web.Application()
    app.router.add_post("/v1/chat/completions", completions)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/v1"
    await runner.cleanup()


async def test_provider_and_response_model_come_from_the_backend(
    hosted, replying, template, span_exporter, capture
):
    backend = OpenAICompatBackend(hosted, "gpt-x", backoff=0.0)
    try:
        await TracingLLM(backend, None, model_name="gpt-x").chat([{"role": "user", "content": "?"}])
    finally:
        await backend.aclose()
    (span,) = chat_spans(span_exporter, "chat gpt-x")
    attrs = span.attributes
    assert (attrs["gen_ai.provider.name"], attrs["gen_ai.request.model"]) == ("openai", "gpt-x")
    assert (attrs["gen_ai.response.id"], attrs["gen_ai.response.model"]) == (
        "chatcmpl-42",
        "gpt-x-0613",
    )
    assert attrs["gen_ai.usage.input_tokens"] == 9
    assert attrs["gen_ai.usage.cache_read.input_tokens"] == 4

    # Cross-sampling: the span names the model that answered, not the one asked for.
    first, second = await replying("a"), await replying("b")
    mixed = CrossSamplingBackend(
        SGLangBackend([first.url]),
        SGLangBackend([second.url]),
        1.0,
        primary_name="tiny",
        secondary_name="other",
    )
    try:
        await TracingLLM(mixed, template, model_name="tiny").chat(
            [{"role": "user", "content": "?"}]
        )
    finally:
        await mixed.aclose()
    (span,) = chat_spans(span_exporter)
    assert span.attributes["gen_ai.provider.name"] == "sglang"
    assert span.attributes["gen_ai.response.model"] == "other"


async def test_failed_calls_carry_error_type(replying, template, span_exporter, capture):
    capture("true")
    refusing = await replying("x")
    refusing.failures = [400]
    for url, error in ((dead_url(), BackendUnavailable), (refusing.url, BadRequest)):
        backend = SGLangBackend([url], retries=0, backoff=0.0)
        try:
            llm = TracingLLM(backend, template, Sampling(), model_name="tiny")
            with pytest.raises(error):
                await llm.chat([{"role": "user", "content": "2+3?"}])
        finally:
            await backend.aclose()
    spans = chat_spans(span_exporter)
    assert [s.attributes["error.type"] for s in spans] == ["BackendUnavailable", "BadRequest"]
    for span in spans:
        assert span.status.status_code is StatusCode.ERROR
        # What was asked is there even though nothing came back.
        assert span.attributes["gen_ai.provider.name"] == "sglang"
        assert json.loads(span.attributes["gen_ai.input.messages"])[0]["role"] == "user"
        assert "gen_ai.output.messages" not in span.attributes


async def test_every_span_has_a_kind_and_train_steps_link_the_rollout_spans(
    js, topology, tmp_path, span_exporter, capture
):
    capture("true")
    fake = FakeSGLang()
    await fake.start()
    try:
        tasks = [{"task_id": f"t{i}", "prompt": f"repeat {i}"} for i in range(2)]
        await TaskProducer(js, topology).submit("echo", tasks, run="linked", group_size=4)
        from agentlib import echo

        async with worker_for(js, "echo", echo, [fake.url], topology=topology) as worker:
            await worker.run()
    finally:
        await fake.close()
    config = TrainerConfig(
        run="linked",
        agent="echo",
        model_dir=str(ensure_tiny_model()),
        group_size=4,
        groups_per_step=2,
        metrics_path=str(tmp_path / "metrics.csv"),
    )
    summary = await Trainer(config, js, topology=topology).run(max_steps=1)
    assert summary.trained == 8

    spans = span_exporter.get_finished_spans()
    kinds: dict[str, set] = {}
    for span in spans:
        kinds.setdefault(span.name, set()).add(span.attributes.get(KIND))
    assert kinds == {
        "publish tasks": {"CHAIN"},
        "rollout": {"AGENT"},
        "chat tiny": {"LLM"},
        "train step": {"CHAIN"},
    }
    rollouts = [s for s in spans if s.name == "rollout"]
    (step,) = [s for s in spans if s.name == "train step"]
    linked = {(link.context.trace_id, link.context.span_id) for link in step.links}
    assert all(link.context.is_valid and link.context.span_id for link in step.links)
    assert linked == {(s.context.trace_id, s.context.span_id) for s in rollouts}
    assert len(linked) == 8
    # With content capture on, a rollout shows its task and outcome.
    task = json.loads(rollouts[0].attributes["input.value"])
    assert task["prompt"].startswith("repeat ")
    assert json.loads(rollouts[0].attributes["output.value"])["status"] == "ok"
