"""Hermes/Qwen tool-call parsing: OpenAI-style calls out, malformed blocks reported, no crash."""

from __future__ import annotations

import json

from agentarium.formats.toolcalls import arguments_as_objects, parse_tool_calls


def test_plain_text_has_no_calls():
    parsed = parse_tool_calls("The answer is 4.")
    assert parsed.content == "The answer is 4."
    assert parsed.tool_calls == [] and parsed.errors == []


def test_one_call_with_content_before_it():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": "x\\u00e9"}}\n</tool_call>'
    parsed = parse_tool_calls(text)
    assert parsed.content == "Let me add."
    (call,) = parsed.tool_calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "add"
    assert isinstance(call["function"]["arguments"], str)
    assert json.loads(call["function"]["arguments"]) == {"a": 2, "b": "xé"}
    assert "é" in call["function"]["arguments"]  # not ASCII-escaped
    assert parsed.errors == []


def test_several_calls_get_distinct_ids():
    text = (
        '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    )
    parsed = parse_tool_calls(text)
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["a", "b"]
    assert parsed.tool_calls[1]["function"]["arguments"] == '{"x": 1}'
    assert len({c["id"] for c in parsed.tool_calls}) == 2
    assert parsed.content == ""


def test_unclosed_final_block_is_parsed():
    # Generation stopped on EOS (or on "</tool_call>" as a stop string, trimmed from the text).
    parsed = parse_tool_calls('<tool_call>\n{"name": "search", "arguments": {"q": "nats"}}\n')
    assert parsed.tool_calls[0]["function"]["name"] == "search"
    assert parsed.errors == []


def test_parameters_alias_and_missing_arguments():
    parsed = parse_tool_calls(
        '<tool_call>{"name": "a", "parameters": {"k": 1}}</tool_call>'
        '<tool_call>{"name": "b"}</tool_call>'
    )
    assert json.loads(parsed.tool_calls[0]["function"]["arguments"]) == {"k": 1}
    assert parsed.tool_calls[1]["function"]["arguments"] == "{}"


def test_malformed_blocks_are_errors_and_stay_in_the_content():
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,}\n</tool_call>'
    good = '<tool_call>\n{"name": "ok", "arguments": {}}\n</tool_call>'
    no_name = '<tool_call>{"arguments": {}}</tool_call>'
    not_object = "<tool_call>[1, 2]</tool_call>"
    truncated = '<tool_call>\n{"name": "add", "argum'
    parsed = parse_tool_calls(f"before {bad} {good} {no_name} {not_object} {truncated}")
    assert [c["function"]["name"] for c in parsed.tool_calls] == ["ok"]
    assert [e.raw for e in parsed.errors] == [bad, no_name, not_object, truncated]
    assert all(e.message for e in parsed.errors)
    assert "name" in parsed.errors[1].message
    for raw in (bad, no_name, not_object, truncated):
        assert raw in parsed.content
    assert good not in parsed.content


def test_arguments_string_is_decoded_for_rendering():
    messages = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "1", "type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}},
                {"id": "2", "type": "function", "function": {"name": "b", "arguments": "not json"}},
            ],
        },
    ]
    decoded = arguments_as_objects(messages)
    assert decoded[1]["tool_calls"][0]["function"]["arguments"] == {"x": 1}
    assert decoded[1]["tool_calls"][1]["function"]["arguments"] == "not json"
    assert messages[1]["tool_calls"][0]["function"]["arguments"] == '{"x": 1}'  # input untouched
