"""The families' chat templates (formats/families.py): each names its own formats, and a
rendered multi-turn conversation with tools and reasoning (two rounds of calls, one of two
calls at once, then an answer) tokenizes back to its text and parses back, turn by turn, to
the messages rendered: reasoning, content and each call's name and arguments."""

from __future__ import annotations

import json
import re

import pytest
from familytools import TOOLS

from agentarium.formats import ChatTemplate, parse_reply
from agentarium.formats.families import FAMILIES, Family


def call(n: int, city: str, days: int) -> dict:
    arguments = {"city": city, "days": days}
    return {"id": f"c{n}", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip


def conversation(family: Family) -> list[dict]:
    """What a tool-using rollout of ``family``'s model holds: reasoning where the family has it,
    text beside the calls where its format allows it (Llama 3's reply is the call alone)."""
    thinks = family.reasoning_format != "none"
    beside_calls = family.tool_format != "llama3_json"

    def assistant(content: str, reasoning: str, calls: list[dict]) -> dict:
        message: dict = {
            "role": "assistant",
            "content": content if beside_calls or not calls else "",
        }
        if thinks:
            message["reasoning_content"] = reasoning
        if calls:
            message["tool_calls"] = calls
        return message

    def result(n: int, text: str) -> dict:
        return {"role": "tool", "tool_call_id": f"c{n}", "name": "get_weather", "content": text}

    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "The weather in Paris for 3 days, then Rome and Oslo?"},
        assistant("Paris first.", "Paris needs one call.", [call(1, "Paris", 3)]),
        result(1, "sunny"),
        assistant("Now both.", "Rome and Oslo at once.", [call(2, "Rome", 1), call(3, "Oslo", 2)]),
        result(2, "rain"),
        result(3, "snow"),
        assistant("Paris sunny, Rome rain, Oslo snow.", "All three are in.", []),
    ]


def assistant_turns(text: str, family: Family) -> list[str]:
    """Each assistant turn's text in a rendering."""
    if family.tool_format == "harmony":  # a turn is the assistant's consecutive messages
        turns: list[list[str]] = []
        previous = ""
        for piece in text.split("<|start|>")[1:]:
            role = re.match(r"[^<]*", piece).group(0)
            if role.startswith("assistant"):
                if not previous.startswith("assistant"):
                    turns.append([])
                turns[-1].append(piece)
            previous = role
        return ["<|start|>" + "<|start|>".join(turn) for turn in turns]
    opener = re.compile("|".join(re.escape(o) for o in family.assistant_open))
    closer = re.compile("|".join(re.escape(c) for c in family.turn_close))
    turns, start = [], 0
    for end in closer.finditer(text):  # a turn starts after the last opener before its end
        openers = list(opener.finditer(text, start, end.start()))
        if openers:
            turns.append(text[openers[-1].end() : end.start()])
        start = end.end()
    return turns


@pytest.fixture(scope="module")
def tokenizer(template):
    return template.tokenizer


@pytest.fixture(scope="module")
def template():
    from agentarium.tiny import ensure_tiny_model

    return ChatTemplate.from_model_dir(ensure_tiny_model())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_rendered_conversation_parses_back_to_its_messages(name, template):
    family = FAMILIES[name]
    chat = ChatTemplate(template.tokenizer, {"default": family.template}, name=name)
    assert chat.reply_formats == (family.tool_format, family.reasoning_format)
    assert chat.renders_tools()
    messages = conversation(family)
    text = chat.render(messages, tools=TOOLS, add_generation_prompt=False)
    assert template.decode(template.encode(text)) == text  # tokenizes back to its text
    assert "get_weather" in text.split("Paris")[0]  # the tools are described before the talk
    wanted = [m for m in messages if m["role"] == "assistant"]
    turns = assistant_turns(text, family)
    assert len(turns) == len(wanted), turns
    for turn, message in zip(turns, wanted, strict=True):
        reply = parse_reply(
            turn,
            tool_format=family.tool_format,
            reasoning_format=family.reasoning_format,
            tools=TOOLS,
        )
        assert not reply.errors, reply.errors
        assert reply.reasoning == message.get("reasoning_content"), turn
        assert reply.content == message["content"], turn
        got = [
            (c["function"]["name"], json.loads(c["function"]["arguments"]))
            for c in reply.tool_calls
        ]
        want = [
            (c["function"]["name"], c["function"]["arguments"])
            for c in message.get("tool_calls", [])
        ]
        assert got == want, turn
    # the generation prompt ends where the family's model starts writing
    assert chat.render(messages[:2], tools=TOOLS).endswith(GENERATION_PROMPT[name])


GENERATION_PROMPT = {
    "qwen3": "<|im_start|>assistant\n",
    "qwen3_coder": "<|im_start|>assistant\n",
    "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
    "mistral": "[/INST]",  # the reply follows the instruction directly
    "deepseek_v3": "<｜Assistant｜><think>\n",  # R1's: the prompt opens the reasoning
    "gpt_oss": "<|start|>assistant",
}


def test_every_tool_format_has_a_family():
    from agentarium.formats import TOOL_FORMATS

    assert {f.tool_format for f in FAMILIES.values()} == set(TOOL_FORMATS)
