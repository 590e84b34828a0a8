"""TracingLLM: exact tokens recorded per call, tool calls parsed, sampling overrides, spans.

Runs against the real local engine serving the tiny model when it starts here, else against
the fake server; tool-call tests always use the fake (the tiny model's output is random bytes).
"""

from __future__ import annotations

import json

import pytest
from agentlib import add_tool
from fake_sglang import dead_url
from opentelemetry import context as otel_context
from opentelemetry import trace

from agentarium.consumers.backends import GenerateRequest, GenerateResult, SGLangBackend
from agentarium.consumers.errors import BackendUnavailable, BadRequest
from agentarium.consumers.tracing.llm import ChatResult, TracingLLM
from agentarium.formats.chat_template import ChatTemplate
from agentarium.formats.toolcalls import arguments_as_objects
from agentarium.schemas import LLMCall, Sampling, Trajectory, decode, encode

TOOLS = [add_tool()]
TOOL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
QUESTION = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture
async def backend(engine_url):
    backend = SGLangBackend([engine_url], backoff=0.0)
    yield backend
    await backend.aclose()


@pytest.fixture
def spans(span_exporter):
    return span_exporter


def make_llm(backend, template, **kwargs) -> TracingLLM:
    kwargs.setdefault("job_sampling", Sampling(temperature=0.0, max_new_tokens=12))
    return TracingLLM(
        backend,
        template,
        route_key=kwargs.pop("route_key", "group-1"),
        rid_prefix=kwargs.pop("rid_prefix", "job-1"),
        model_name=kwargs.pop("model_name", "tiny"),
        **kwargs,
    )


async def test_records_the_exact_tokens(backend, template):
    llm = make_llm(backend, template)
    result = await llm.chat(QUESTION)
    assert isinstance(result, ChatResult)
    (call,) = llm.calls
    assert result.call is call
    assert call.prompt_ids == template.encode_chat(QUESTION)
    assert 0 < len(call.response_ids) <= 12
    assert len(call.response_logprobs) == len(call.response_ids)
    assert all(lp <= 0 for lp in call.response_logprobs)
    assert call.finish_reason == result.finish_reason
    assert call.finish_reason in ("stop", "length")
    assert call.weight_version == "default"
    assert (call.temperature, call.top_p, call.top_k) == (0.0, 1.0, -1)
    assert call.backend == backend.urls[0] and call.model == "tiny"
    assert call.latency_s > 0
    # The text is the decode of the very ids recorded: no re-tokenization anywhere.
    assert result.text == template.decode(call.response_ids, skip_special_tokens=True)
    assert result.message == {"role": "assistant", "content": result.text}
    assert call.messages == [*QUESTION, result.message]
    # The call survives the wire.
    wire = Trajectory(
        job_id="job-1", agent="a", task_id="t", group_id="g", status="ok", reward=1.0, calls=[call]
    )
    back = decode(Trajectory, encode(wire)).calls[0]
    assert back.prompt_ids == call.prompt_ids and back.response_ids == call.response_ids
    assert back.response_logprobs == pytest.approx(call.response_logprobs, rel=1e-6)  # float32


async def test_multi_turn_keeps_every_call(backend, template):
    llm = make_llm(backend, template)
    messages = list(QUESTION)
    first = await llm.chat(messages)
    messages += [first.message, {"role": "user", "content": "And 3+4?"}]
    second = await llm.chat(messages)
    assert [c for c in llm.calls] == [first.call, second.call]
    assert (first.call.prompt_build, second.call.prompt_build) == ("render", "extend")
    # The second prompt is the first one, the ids sampled, then the rest of the rendering:
    # the reply's text is never encoded again (the tiny model's random bytes often would not
    # come back as the same ids).
    seen = first.call.prompt_ids + first.call.response_ids
    assert second.call.prompt_ids[: len(seen)] == seen
    rest = template.decode(second.call.prompt_ids[len(seen) :])
    assert rest.endswith("<|im_start|>user\nAnd 3+4?<|im_end|>\n<|im_start|>assistant\n")
    assert second.call.messages == [*messages, second.message]
    assert first.call.messages == [*QUESTION, first.message]  # not mutated by later turns


class Spy:
    """A backend wrapper that keeps the requests it saw."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.requests: list[GenerateRequest] = []

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        self.requests.append(request)
        return await self.inner.generate(request)


async def test_per_call_sampling_overrides_the_job(backend, template):
    spy = Spy(backend)
    job = Sampling(temperature=1.0, top_p=1.0, max_new_tokens=16, stop=("zz",))
    llm = make_llm(spy, template, job_sampling=job)
    await llm.chat(QUESTION)
    assert spy.requests[0].sampling == {
        "max_new_tokens": 16,
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop": ["zz"],
        "stop_token_ids": [258, 256],
    }
    result = await llm.chat(QUESTION, temperature=0.0, top_p=0.9, top_k=5, max_tokens=3, stop="\n")
    assert spy.requests[1].sampling == {
        "max_new_tokens": 3,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 5,
        "stop": ["\n"],
        "stop_token_ids": [258, 256],
    }
    assert len(result.call.response_ids) <= 3
    assert (result.call.temperature, result.call.top_p, result.call.top_k) == (0.0, 0.9, 5)
    assert spy.requests[0].rid != spy.requests[1].rid
    assert spy.requests[0].rid.startswith("job-1-") and spy.requests[1].rid.endswith("-call-1")
    assert {r.route_key for r in spy.requests} == {"group-1"}
    with pytest.raises(TypeError, match="unknown sampling option 'temprature'"):
        await llm.chat(QUESTION, temprature=0.5)
    with pytest.raises(ValueError, match="top_p"):
        await llm.chat(QUESTION, top_p=0.0)
    assert len(llm.calls) == 2


async def test_tool_calls_are_parsed(replying, template):
    fake = await replying(f"I will add.\n{TOOL_TEXT}")
    backend = SGLangBackend([fake.url], backoff=0.0)
    try:
        llm = make_llm(backend, template, job_sampling=Sampling(max_new_tokens=256))
        result = await llm.chat(QUESTION, tools=TOOLS)
        assert fake.requests[0]["input_ids"] == template.encode_chat(QUESTION, tools=TOOLS)
        assert result.finish_reason == "tool_calls" and result.call.finish_reason == "tool_calls"
        (call,) = result.tool_calls
        assert call["function"]["name"] == "add"
        assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": 3}
        assert result.message["content"] == "I will add."
        assert result.text.endswith("</tool_call>")
        assert result.call.response_ids == template.encode(result.text) + [258]

        # Next turn: the OpenAI-shaped call (arguments as a JSON string) renders as generated.
        messages = [
            *QUESTION,
            result.message,
            {"role": "tool", "tool_call_id": call["id"], "content": "5"},
        ]
        await llm.chat(messages, tools=TOOLS)
        prompt = fake.requests[1]["input_ids"]
        assert prompt == template.encode_chat(arguments_as_objects(messages), tools=TOOLS)
        assert '{"name": "add", "arguments": {"a": 2, "b": 3}}' in template.decode(prompt)

        # Without tools offered, the text is left alone.
        plain = await llm.chat(QUESTION)
        assert plain.finish_reason == "stop" and "tool_calls" not in plain.message
        assert plain.message["content"] == result.text
    finally:
        await backend.aclose()


async def test_malformed_tool_call_is_recorded_not_raised(replying, template):
    fake = await replying('<tool_call>\n{"name": "add", "arguments": {"a": 2,,}}\n</tool_call>')
    backend = SGLangBackend([fake.url], backoff=0.0)
    try:
        llm = make_llm(backend, template, job_sampling=Sampling(max_new_tokens=256))
        result = await llm.chat(QUESTION, tools=TOOLS)
        assert result.finish_reason == "stop" and result.tool_calls == []
        assert len(result.tool_call_errors) == 1
        assert result.message["content"] == result.text
    finally:
        await backend.aclose()


async def test_spans_nest_under_the_rollout(backend, template, spans):
    tracer = trace.get_tracer("test")
    with tracer.start_as_current_span("rollout") as rollout:
        rollout_ctx = otel_context.get_current()
    llm = make_llm(backend, template, parent_context=rollout_ctx)

    # Called with no span active (a proxy handler, a thread): the chat span is the rollout's child.
    result = await llm.chat(QUESTION)
    assert trace.get_current_span() is trace.INVALID_SPAN  # nothing left attached

    # Inside the agent's own span (the worker attached the rollout context): nested under it.
    token = otel_context.attach(rollout_ctx)
    try:
        with tracer.start_as_current_span("agent step") as step:
            await llm.chat(QUESTION)
            assert trace.get_current_span() is step
    finally:
        otel_context.detach(token)

    finished = {s.name: s for s in spans.get_finished_spans() if s.name != "rollout"}
    chats = [s for s in spans.get_finished_spans() if s.name == "chat tiny"]
    assert len(chats) == 2
    first, second = chats
    assert first.parent.span_id == rollout.get_span_context().span_id
    assert second.parent.span_id == finished["agent step"].context.span_id
    assert {s.context.trace_id for s in chats} == {rollout.get_span_context().trace_id}
    assert first.kind == trace.SpanKind.CLIENT
    attrs = first.attributes
    assert attrs["gen_ai.operation.name"] == "chat"
    assert attrs["gen_ai.request.model"] == "tiny"
    assert attrs["gen_ai.usage.input_tokens"] == len(result.call.prompt_ids)
    assert attrs["gen_ai.usage.output_tokens"] == len(result.call.response_ids)
    assert tuple(attrs["gen_ai.response.finish_reasons"]) == (result.finish_reason,)
    assert attrs["agentarium.weight_version"] == "default"
    assert attrs["server.address"] == "127.0.0.1"


async def test_backend_errors_reach_the_agent_and_the_span(template, spans):
    backend = SGLangBackend([dead_url()], retries=0, backoff=0.0)
    try:
        llm = make_llm(backend, template, model_name="m")
        with pytest.raises(BackendUnavailable) as info:
            await llm.chat(QUESTION)
        assert llm.calls == [] and llm.errors == [info.value]
        (span,) = [s for s in spans.get_finished_spans() if s.name == "chat m"]
        assert span.status.status_code == trace.StatusCode.ERROR
    finally:
        await backend.aclose()


async def test_template_refusal_is_a_bad_request(backend, template, tmp_path, tiny_dir):
    import shutil

    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ raise_exception('roles must alternate') }}")
    strict = ChatTemplate.from_model_dir(tmp_path)
    with pytest.raises(BadRequest, match="roles must alternate"):
        await make_llm(backend, strict).chat(QUESTION)
    with pytest.raises(BadRequest, match="ChatTemplate"):
        await make_llm(backend, None).chat(QUESTION)


async def test_chat_native_backend_records_text_only():
    class Hosted:
        """Stands in for OpenAICompatBackend: messages in, text and tool calls out."""

        def __init__(self) -> None:
            self.requests: list[GenerateRequest] = []

        async def generate(self, request: GenerateRequest) -> GenerateResult:
            self.requests.append(request)
            call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
            return GenerateResult(
                output_ids=[],
                output_logprobs=[],
                text="",
                finish_reason="stop",
                backend="https://api.example/v1",
                tool_calls=[call],
            )

    hosted = Hosted()
    llm = TracingLLM(hosted, None, Sampling(), model_name="gpt-x")
    result = await llm.chat(QUESTION, tools=TOOLS)
    assert hosted.requests[0].messages == QUESTION and hosted.requests[0].input_ids == []
    assert result.finish_reason == "tool_calls" and result.tool_calls[0]["id"] == "c1"
    call: LLMCall = llm.calls[0]
    assert call.prompt_ids == [] and call.response_ids == [] and call.response_logprobs == []
