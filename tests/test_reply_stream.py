"""A reply parsed while it is generated (formats/reply_stream.py): in every family's format, the
deltas it hands on add up to the final parse exactly, whatever pieces the text comes in; it
never hands on text that the final parse turns into a tool call or a marker; and plain text
flows before the reply ends."""

from __future__ import annotations

import random

import pytest
from formatcases import MALFORMED, TOOLS, WELL_FORMED, whole_text_deltas

from agentarium.formats import THINK_CLOSE, THINK_OPEN, ReplyStream, parse_reply
from agentarium.formats.toolcalls import TOOL_FORMATS

MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<｜tool▁calls▁begin｜>", "<|python_tag|>", "<think>")


def stream(text: str, pieces: list[str], **formats) -> tuple[dict, list[tuple], object]:
    """Feed ``pieces`` (adding up to ``text``), then the final parse; returns the assembled
    text per kind, every delta sent before the end (its kind, its text, and the text fed so far
    when it was sent), and the parse."""
    tools = formats.pop("tools", None)
    reply = ReplyStream(tools=bool(tools), **formats)
    assembled = {"reasoning": "", "content": ""}
    sent: list[tuple[str, str, str]] = []
    fed = ""
    for piece in pieces:
        fed += piece
        for delta in reply.feed(piece):
            assembled[delta.kind] += delta.text
            sent.append((delta.kind, delta.text, fed))
    parsed = parse_reply(text, tools=tools, **formats)
    for delta in reply.finish(parsed.reasoning, parsed.content):
        assembled[delta.kind] += delta.text
    assert not reply.diverged, (text, pieces)
    return assembled, sent, parsed


def pieces_of(text: str, rng: random.Random) -> list[str]:
    out, at = [], 0
    while at < len(text):
        size = rng.randint(1, 6)
        out.append(text[at : at + size])
        at += size
    return out


def cases() -> list[tuple[str, str, str]]:
    """(tool format, reasoning format, text): each family's calls, well-formed and not, alone
    and after reasoning and text, and plain answers."""
    out = []
    for fmt in TOOL_FORMATS:
        reasoning = "harmony" if fmt == "harmony" else "think"
        for text in (WELL_FORMED[fmt][0], MALFORMED[fmt], "The weather in Paris is mild. "):
            out.append((fmt, reasoning, text))
            if fmt != "harmony":
                out.append((fmt, reasoning, f"{THINK_OPEN}\nCheck it.\n{THINK_CLOSE}\n\n{text}"))
                out.append((fmt, "none", f"a <b> and {text}  \n"))
    return out


@pytest.mark.parametrize(("tool_format", "reasoning_format", "text"), cases())
def test_the_deltas_add_up_to_the_final_parse_in_any_pieces(tool_format, reasoning_format, text):
    rng = random.Random(f"{tool_format}{reasoning_format}{text}")
    for pieces in ([text], list(text), *(pieces_of(text, rng) for _ in range(20))):
        assembled, sent, parsed = stream(
            text,
            pieces,
            tool_format=tool_format,
            reasoning_format=reasoning_format,
            tools=TOOLS,
        )
        assert assembled == {"reasoning": parsed.reasoning or "", "content": parsed.content}
        live = "".join(piece for _, piece, _ in sent)  # a call or a marker is never sent live
        assert all(marker not in live for marker in MARKERS), (text, pieces)


def test_plain_text_and_reasoning_flow_before_the_reply_ends():
    text = f"{THINK_OPEN}\nFirst I add the units.\n{THINK_CLOSE}\n\nThe answer is 42, I think."
    _, sent, _ = stream(
        text, list(text), tool_format="hermes", reasoning_format="think", tools=TOOLS
    )
    reasoning_at = min(len(fed) for kind, _, fed in sent if kind == "reasoning")
    content_at = min(len(fed) for kind, _, fed in sent if kind == "content")
    # the first reasoning word is out once it is followed by text; the content's first word
    # before the reply's last word
    assert reasoning_at <= len(f"{THINK_OPEN}\nFirst ") + 1
    assert content_at < len(text) - len("I think.")
    assert reasoning_at < content_at


def test_text_before_a_tool_call_flows_and_the_call_is_held_whole():
    text, content = WELL_FORMED["hermes"]
    assembled, sent, parsed = stream(
        text, list(text), tool_format="hermes", reasoning_format="none", tools=TOOLS
    )
    assert assembled["content"] == content == "Let me check."
    # "Let me check." was sure once the call began (its trailing newline held, then dropped)
    assert sent and max(len(fed) for _, _, fed in sent) <= text.index("<tool_call>") + 1
    assert parsed.tool_calls


def test_without_tools_offered_a_call_is_content_and_flows():
    text = WELL_FORMED["hermes"][0]
    assembled, sent, parsed = stream(
        text, list(text), tool_format="hermes", reasoning_format="none", tools=None
    )
    assert assembled["content"] == text == parsed.content
    assert "".join(piece for _, piece, _ in sent) == text  # all of it live


def test_llama3_json_content_is_held_while_it_may_be_a_call():
    text = WELL_FORMED["llama3_json"][0]
    assembled, sent, parsed = stream(
        text, list(text), tool_format="llama3_json", reasoning_format="none", tools=TOOLS
    )
    assert not sent and assembled["content"] == "" and parsed.tool_calls
    answer = "Paris is mild today."
    assembled, sent, _ = stream(
        answer, list(answer), tool_format="llama3_json", reasoning_format="none", tools=TOOLS
    )
    assert assembled["content"] == answer and sent


def test_a_final_text_that_does_not_extend_what_was_sent_is_reported():
    reply = ReplyStream(tool_format=None, reasoning_format="none", tools=False)
    assert [d.text for d in reply.feed("Hello wor")] == ["Hello wor"]
    assert [d.text for d in reply.feed("ld ")] == ["ld"]  # the space may be trimmed: held
    assert reply.finish(None, "Help") == []
    assert reply.diverged


ALPHABET = [THINK_OPEN, THINK_CLOSE, "<tool_call>", "</tool_call>", "[TOOL_CALLS]",
            "<|python_tag|>", "{", " ", "\n", "  ", "a", "Paris", "<", "</", "think", "\u00a0"]  # fmt: skip


@pytest.mark.parametrize("reasoning_format", ["think", "none"])
@pytest.mark.parametrize(
    "tool_format", ["hermes", "mistral", "llama3_json", "deepseek_v3", "qwen3_coder"]
)
def test_each_piece_sends_what_parsing_the_whole_text_so_far_would(tool_format, reasoning_format):
    """The incremental layout (markers searched once, leading whitespace counted once) sends,
    piece for piece, the deltas of reparsing the whole text at every piece: on texts made of
    markers, their fragments, whitespace and words, cut anywhere. (60,000 such cases, 6,000 a
    format pair, agreed when the layout was written; the suite runs 300 a pair.)"""
    rng = random.Random(f"{tool_format}{reasoning_format}")
    for _ in range(300):
        text = "".join(rng.choice(ALPHABET) for _ in range(rng.randint(1, 24)))
        pieces = pieces_of(text, rng) + ([""] if rng.random() < 0.2 else [])
        tools, opened = rng.random() < 0.8, rng.random() < 0.3
        reply = ReplyStream(
            tool_format=tool_format, reasoning_format=reasoning_format, tools=tools, opened=opened
        )
        ours = [[(d.kind, d.text) for d in reply.feed(piece)] for piece in pieces]
        reference = whole_text_deltas(pieces, tool_format, reasoning_format, tools, opened)
        assert ours == reference, (text, pieces, tools, opened)
