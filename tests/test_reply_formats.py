"""Replies in each family's formats split into reasoning, content and OpenAI-style tool calls
(formats/reply.py, reasoning.py, toolcalls.py, harmony.py): what each family's model writes,
well-formed and not, and what its chat template's text says its formats are."""

from __future__ import annotations

import json

import pytest
from formatcases import MALFORMED, TOOLS, WELL_FORMED

from agentarium.formats.harmony import split_harmony
from agentarium.formats.reasoning import detect_reasoning_format, split_reasoning
from agentarium.formats.reply import parse_reply
from agentarium.formats.toolcalls import TOOL_FORMATS, detect_tool_format, parse_tool_calls

CALL = {"city": "Paris", "days": 3}


def calls(parsed) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls
    ]


def test_every_format_has_a_well_formed_case():
    assert set(WELL_FORMED) == set(TOOL_FORMATS)


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_a_well_formed_call_in_each_format(fmt):
    text, content = WELL_FORMED[fmt]
    parsed = parse_tool_calls(text, fmt, tools=TOOLS)
    assert calls(parsed) == [("get_weather", CALL)] and not parsed.errors
    assert parsed.content == content
    call = parsed.tool_calls[0]
    assert call["type"] == "function" and call["id"].startswith("call_")


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_plain_text_is_content_in_every_format(fmt):
    parsed = parse_tool_calls("The weather in Paris is mild.", fmt, tools=TOOLS)
    assert parsed.content == "The weather in Paris is mild." and not parsed.tool_calls
    assert not parsed.errors


@pytest.mark.parametrize("fmt", TOOL_FORMATS)
def test_a_malformed_call_is_an_error_with_its_raw_text_kept(fmt):
    text = MALFORMED[fmt]
    parsed = parse_tool_calls(text, fmt, tools=TOOLS)
    assert not parsed.tool_calls and len(parsed.errors) == 1, parsed
    error = parsed.errors[0]
    assert error.message and error.raw.strip() in text
    assert error.raw.strip() in parsed.content or parsed.content.strip() in text  # nothing lost
    assert parsed.content.strip()


def test_several_calls_in_one_reply():
    two = (
        'x<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b"}</tool_call>'
    )
    assert [n for n, _ in calls(parse_tool_calls(two))] == ["a", "b"]
    llama = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert calls(parse_tool_calls(llama, "llama3_json")) == [("a", {"x": 1}), ("b", {})]
    mistral_v11 = '[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}'
    assert calls(parse_tool_calls(mistral_v11, "mistral")) == [("a", {"x": 1}), ("b", {})]
    deepseek_v31 = (
        '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{"x": 1}<｜tool▁call▁end｜>'
        "<｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    )
    assert calls(parse_tool_calls(deepseek_v31, "deepseek_v3")) == [("a", {"x": 1}), ("b", {})]


def test_qwen3_coder_types_values_by_the_tools_schema():
    text = (
        "<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
        "<parameter=days>\n3\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
        "<parameter=zip>\n07001\n</parameter>\n</function>\n</tool_call>"
    )
    [(_, args)] = calls(parse_tool_calls(text, "qwen3_coder", tools=TOOLS))
    assert args == {"city": "42", "days": 3, "metric": True, "zip": "07001"}  # strings stay text
    [(_, untyped)] = calls(parse_tool_calls(text, "qwen3_coder"))  # no schema: JSON where it is
    assert untyped == {"city": 42, "days": 3, "metric": True, "zip": "07001"}
    bad = text.replace("\n3\n", "\nthree\n")
    assert (
        parse_tool_calls(bad, "qwen3_coder", tools=TOOLS)
        .errors[0]
        .message.startswith("parameter value 'three'")
    )


def test_a_json_answer_is_not_a_llama_call():
    text = '{"answer": 42}'
    parsed = parse_tool_calls(text, "llama3_json", tools=TOOLS)
    assert parsed.content == text and not parsed.tool_calls and not parsed.errors


def test_an_unknown_format_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="one of hermes, qwen3_coder"):
        parse_tool_calls("x", "pythonic")


@pytest.mark.parametrize(
    ("text", "opened", "reasoning", "content"),
    [
        ("<think>\nadd 2 and 2\n</think>\n\n4", False, "add 2 and 2", "4"),  # Qwen3
        ("add 2 and 2\n</think>\n\n4", False, "add 2 and 2", "4"),  # the prompt opened it (R1)
        ("<think>\nadd 2 and", False, "add 2 and", ""),  # stopped inside the block
        ("add 2 and", True, "add 2 and", ""),  # the same, the prompt having opened it
        ("4", False, None, "4"),  # no reasoning
        ("<think>\n\n</think>\n\n4", False, "", "4"),  # thinking turned off: an empty block
    ],
)
def test_think_blocks(text, opened, reasoning, content):
    split = split_reasoning(text, "think", opened=opened)
    assert (split.reasoning, split.content) == (reasoning, content)


def test_a_call_drafted_in_the_reasoning_is_not_made():
    draft = '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>'
    made = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    )
    text = f"<think>maybe {draft}? no, Paris</think>\nChecking. {made}"
    reply = parse_reply(text, tool_format="hermes", reasoning_format="think", tools=TOOLS)
    assert reply.reasoning == f"maybe {draft}? no, Paris"
    assert calls(reply) == [("get_weather", CALL)] and reply.content == "Checking."
    # without tools offered, the text is content, markers and all
    plain = parse_reply(text, tool_format="hermes", reasoning_format="think")
    assert plain.content == f"Checking. {made}" and not plain.tool_calls


def test_harmony_channels():
    text = (
        "<|channel|>analysis<|message|>The user wants weather.<|end|><|start|>assistant"
        '<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": '
        '"Paris", "days": 3}<|call|>'
    )
    reply = parse_reply(text, tool_format="harmony", reasoning_format="harmony", tools=TOOLS)
    assert reply.reasoning == "The user wants weather." and reply.content == ""
    assert calls(reply) == [("get_weather", CALL)]
    final = split_harmony(
        "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
        "<|message|>4<|return|>"
    )
    assert (final.reasoning, final.content, final.tool_calls) == ("Easy.", "4", [])
    # the recipient before the channel, as gpt-oss also writes it
    before = split_harmony(
        '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city":'
        ' "Paris", "days": 3}<|call|>'
    )
    assert calls(before) == [("get_weather", CALL)]
    assert split_harmony("no channels here").content == "no channels here"


@pytest.mark.parametrize(
    ("template", "tool_format", "reasoning_format"),
    [
        ("{{- '<tool_call>\\n' }}{{ tool_call | tojson }}", "hermes", "none"),
        ("<tool_call>{{ x }}<think>", "hermes", "think"),  # Qwen3
        ("<tool_call>\\n<function={{ name }}>\\n<parameter=", "qwen3_coder", "none"),
        ("[TOOL_CALLS][{{ calls | tojson }}]", "mistral", "none"),
        ("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{{ name }}</think>", "deepseek_v3", "think"),
        ("<|start|>assistant<|channel|>analysis<|message|>", "harmony", "harmony"),
        ('<|python_tag|>{"name": "{{ name }}", "parameters": ', "llama3_json", "none"),
        ("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}", None, "none"),  # SmolLM2
    ],
)
def test_formats_are_read_from_the_chat_template(template, tool_format, reasoning_format):
    assert detect_tool_format(template) == tool_format
    assert detect_reasoning_format(template) == reasoning_format


THINKING_REPLY = (
    "2 and 3: the add tool.\n</think>\n\nI will add.\n"
    '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
)


@pytest.fixture
def thinking(template):
    """The tiny model's template as a thinking model's: the generation prompt opens a
    ``<think>`` block (as DeepSeek-R1's and Qwen3's thinking templates do)."""
    from agentarium.formats import ChatTemplate

    source = template.template_source(tools=())
    opened = source.replace("'<|im_start|>assistant\\n'", "'<|im_start|>assistant\\n<think>\\n'")
    assert opened != source
    return ChatTemplate(
        template.tokenizer, {"default": opened}, eos_token_ids=template.eos_token_ids
    )


async def test_the_tracing_client_and_the_gateway_return_a_thinking_models_reasoning(
    replying, thinking
):
    """The client splits the reasoning off (the template opened the block: the reply has the
    close only), parses the tool call in the content alone, keeps the engine's ids whole; Chat
    Completions returns it as ``reasoning_content``, whole and in stream deltas, which the
    official openai SDK reads."""
    import openai.types.chat as oai
    from agentlib import add_tool

    from agentarium.consumers.backends import SGLangBackend
    from agentarium.consumers.tracing.gateway.chat import ChatStream, completion
    from agentarium.consumers.tracing.llm import TracingLLM
    from agentarium.schemas import Sampling

    assert thinking.reply_formats == ("hermes", "think")
    fake = await replying(THINKING_REPLY)
    backend = SGLangBackend([fake.url], backoff=0.0)
    try:
        llm = TracingLLM(backend, thinking, Sampling(max_new_tokens=256), model_name="tiny")
        result = await llm.chat([{"role": "user", "content": "2+3?"}], tools=[add_tool()])
    finally:
        await backend.aclose()
    assert result.reasoning == "2 and 3: the add tool." and result.content == "I will add."
    assert [c["function"]["name"] for c in result.tool_calls] == ["add"]
    assert result.call.response_ids == thinking.encode(THINKING_REPLY) + [258]  # token-exact

    body = oai.ChatCompletion.model_validate(completion(result, "tiny"))
    message = body.choices[0].message
    assert message.model_extra["reasoning_content"] == result.reasoning
    assert message.content == "I will add." and message.tool_calls[0].function.name == "add"
    chunks = [
        oai.ChatCompletionChunk.model_validate_json(raw.decode().removeprefix("data: ").strip())
        for raw in ChatStream("tiny", include_usage=False).events(result)
        if raw.startswith(b"data: {")
    ]
    streamed = "".join(
        (c.choices[0].delta.model_extra or {}).get("reasoning_content") or "" for c in chunks
    )
    assert streamed == result.reasoning
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == result.content
    check_responses(result)
    check_messages(result)


def sse_data(events) -> list[dict]:
    out = []
    for raw in events:
        for line in raw.decode().splitlines():
            if line.startswith("data: {"):
                out.append(json.loads(line.removeprefix("data: ")))
    return out


def check_responses(result) -> None:
    """A reasoning item first (its text a reasoning_text part), whole and streamed; sent back
    in ``input``, it is the assistant turn's reasoning_content again."""
    from openai.types.responses import Response

    from agentarium.consumers.tracing.gateway.responses import ResponseShape, input_messages

    shape = ResponseShape({}, "tiny")
    whole = shape.response(result)
    # the SDK's own types (3.x) require usage fields the gateway has no figure for
    # (cache_write_tokens): the items are what is checked here
    body = Response.model_validate({**whole, "usage": None})
    reasoning, message, call = body.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == result.reasoning
    assert message.type == "message" and call.type == "function_call" and call.name == "add"
    events = sse_data(ResponseShape({}, "tiny").events(result))
    streamed = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    assert streamed == result.reasoning
    assert [e["text"] for e in events if e["type"] == "response.reasoning_text.done"] == [
        result.reasoning
    ]
    back = input_messages([item.model_dump(exclude_none=True) for item in body.output])
    assert back == [
        {
            "role": "assistant",
            "content": "I will add.",
            "reasoning_content": result.reasoning,
            "tool_calls": [
                {"id": call.call_id, "type": "function", "function": {"name": "add",
                 "arguments": call.arguments}}
            ],
        }
    ]  # fmt: skip


def check_messages(result) -> None:
    """A thinking block first, whole and streamed (thinking_delta); sent back, the turn's
    reasoning_content."""
    from anthropic.types import Message

    from agentarium.consumers.tracing.gateway.anthropic import MessageShape, chat_messages

    shape = MessageShape("tiny")
    body = Message.model_validate(shape.message(result))
    thinking, text, tool = body.content
    assert thinking.type == "thinking" and thinking.thinking == result.reasoning
    assert text.type == "text" and tool.type == "tool_use" and tool.input == {"a": 2, "b": 3}
    events = sse_data(MessageShape("tiny").events(result))
    deltas = [e["delta"] for e in events if e["type"] == "content_block_delta"]
    streamed = "".join(d["thinking"] for d in deltas if d["type"] == "thinking_delta")
    assert streamed == result.reasoning
    result_block = {"type": "tool_result", "tool_use_id": tool.id, "content": "5"}
    sent_back = [
        {"role": "user", "content": "2+3?"},
        {"role": "assistant", "content": [b.model_dump() for b in body.content]},
        {"role": "user", "content": [result_block]},
    ]
    _, turn, _ = chat_messages(None, sent_back)
    assert turn["reasoning_content"] == result.reasoning and turn["content"] == "I will add."
    assert turn["tool_calls"][0]["function"]["name"] == "add"


def test_what_does_not_parse_is_kept_and_nothing_is_invented():
    """Text a parser cannot place stays in the content with an error; a JSON answer that merely
    has a "name" is no Llama call; a nullable string parameter stays the text written."""
    loose = "Sure.<｜tool▁calls▁begin｜>I will call get_weather<｜tool▁calls▁end｜>"
    parsed = parse_tool_calls(loose, "deepseek_v3", tools=TOOLS)
    assert not parsed.tool_calls and "I will call get_weather" in parsed.content
    assert parsed.errors and "not a call" in parsed.errors[0].message
    trailing = split_harmony("<|channel|>final<|message|>Hi<|end|>trailing words")
    assert trailing.content == "Hi\n\ntrailing words"
    answer = '{"name": "Alice", "age": 3}'
    parsed = parse_tool_calls(answer, "llama3_json", tools=TOOLS)
    assert parsed.content == answer and not parsed.tool_calls and not parsed.errors
    nullable = [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object",
         "properties": {"code": {"type": ["string", "null"]}}}}}
    ]  # fmt: skip
    text = (
        "<tool_call>\n<function=f>\n<parameter=code>\n123\n</parameter>\n</function>\n</tool_call>"
    )
    [(_, args)] = calls(parse_tool_calls(text, "qwen3_coder", tools=nullable))
    assert args == {"code": "123"}


def test_a_long_unterminated_harmony_reply_is_read_in_linear_time():
    """An early policy's garbage: one message marker, then 200,000 characters with no end.
    The scan is linear (a quadratic one took ~90 s at 100,000); this bounds it generously."""
    import time

    started = time.perf_counter()
    split_harmony("<|channel|>final<|message|>" + "x<|" * 100_000)
    assert time.perf_counter() - started < 5.0
