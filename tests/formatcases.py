"""The reply-format cases the format tests share: one well-formed reply per tool-call format
(``WELL_FORMED``: the text, a ``get_weather`` call, and what is left as content), one malformed
reply per format (``MALFORMED``), and the tool they call (``TOOLS``: ``WEATHER`` alone), as
tests/test_reply_formats.py parses them whole and tests/test_reply_stream.py piece by piece;
and ``whole_text_deltas``, the streaming reference those pieces are held to (bench/reply_stream.py
times ReplyStream against it)."""

from __future__ import annotations

from agentarium.formats import THINK_CLOSE, THINK_OPEN

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "metric": {"type": "boolean"},
                "zip": {"type": "string"},
            },
        },
    },
}
TOOLS = [WEATHER]

# One well-formed reply per format: text before the call, the call, and what is left as content.
WELL_FORMED = {
    "hermes": (
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}\n</tool_call>',
        "Let me check.",
    ),
    "qwen3_coder": (
        "Let me check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>",
        "Let me check.",
    ),
    "llama3_json": ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}', ""),
    "mistral": (
        'Let me check.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", '
        '"days": 3}}]',
        "Let me check.",
    ),
    "deepseek_v3": (
        "Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Paris", "days": 3}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
        "Let me check.",
    ),
    "harmony": (
        "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant<|channel|>"
        'commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
        '"days": 3}<|call|>',
        "Let me check.",
    ),
}

MALFORMED = {
    "hermes": '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>',
    "qwen3_coder": "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",
    "llama3_json": '{"name": "get_weather", "parameters": {"city": "Paris"} and more',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": ]',
    "deepseek_v3": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    "no fence<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "harmony": "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    "{city: Paris}<|call|>",
}


def whole_text_deltas(pieces: list[str], tool_format, reasoning_format, tools, opened):
    """The deltas of ReplyStream's first design, kept as the reference: at every piece, the
    whole text so far (cut at a call's start, a marker's possible start held back) parsed by
    ``split_reasoning`` and compared with what was sent."""
    from agentarium.formats.incremental import partial_suffix
    from agentarium.formats.reasoning import split_reasoning
    from agentarium.formats.reply_stream import CALL_MARKERS
    from agentarium.formats.toolcalls import PYTHON_TAG

    fmt = tool_format if tools else None
    calls = CALL_MARKERS.get(fmt or "", ())
    markers = ((THINK_OPEN, THINK_CLOSE) if reasoning_format == "think" else ()) + calls
    text, sent, out = "", {"reasoning": "", "content": ""}, []
    for piece in pieces:
        text += piece
        if not piece:
            out.append([])
            continue
        end = min([len(text)] + [at for m in calls if (at := text.find(m)) != -1])
        split = split_reasoning(text[: end - partial_suffix(text, markers, 0, end)],
                                reasoning_format, opened=opened)  # fmt: skip
        deltas = []
        targets = []
        if split.reasoning is not None and not sent["content"]:
            targets.append(("reasoning", split.reasoning.rstrip()))
        start = split.content.lstrip()
        held = fmt == "llama3_json" and (
            start.startswith("{") or PYTHON_TAG.startswith(start[: len(PYTHON_TAG)])
        )
        if split.content and not held:
            targets.append(("content", split.content.rstrip()))
        for kind, target in targets:
            if len(target) > len(sent[kind]) and target.startswith(sent[kind]):
                deltas.append((kind, target[len(sent[kind]) :]))
                sent[kind] = target
        out.append(deltas)
    return out
