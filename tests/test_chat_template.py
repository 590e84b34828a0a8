"""ChatTemplate gives the same prompt text and ids as transformers' apply_chat_template."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from agentarium.formats import ToolsNotRendered
from agentarium.formats.chat_template import ChatTemplate
from agentarium.tiny import ensure_tiny_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two numbers <exactly> & return the sum (é)",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
                "required": ["a", "b"],
            },
        },
    },
    {
        "type": "function",
        "function": {"name": "search", "description": "Search", "parameters": {"type": "object"}},
    },
]
SINGLE = [{"role": "user", "content": "What is 2+3?"}]
WITH_SYSTEM = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Héllo 你好 <b>&</b>\n\n  spaced  "},
]
TOOL_TURNS = [
    {"role": "user", "content": "Add 2 and 3, then search for nats."},
    {
        "role": "assistant",
        "content": None,  # as the OpenAI SDK sends it: dropped, not rendered as "None"
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": {"a": 2, "b": 3}},
            },
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "search", "arguments": {"q": "nats"}},
            },
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"hits": ["nats.io"]}'},
    {"role": "assistant", "content": "The sum is 5; nats.io is the site."},
    {"role": "user", "content": "Thanks <|im_end|> literally"},
]

# Exercises every piece of the environment transformers sets up: bos_token, raise_exception,
# strftime_now, namespace, dict(), loopcontrols, tojson options, {% generation %}, reasoning
# aliases, and trim_blocks/lstrip_blocks on non-dash tags.
KITCHEN_SINK = """{{ bos_token }}
{% set ns = namespace(count=0) %}
{% for message in messages %}
  {% if message.role not in ['system', 'user', 'assistant', 'tool'] %}
    {{ raise_exception('unknown role ' + message.role) }}
  {% endif %}
  {% if message.role == 'system' and not loop.first %}{% continue %}{% endif %}
  {% set ns.count = ns.count + 1 %}
<|im_start|>{{ message.role }}
  {% if message.role == 'assistant' %}
    {% generation %}
    {% if message.reasoning_content is defined %}<think>{{ message.reasoning_content }}</think>{% endif %}
{{ message.content if message.content is defined else '' }}
    {% for call in message.tool_calls or [] %}
<tool_call>{{ call.function | tojson(indent=2, sort_keys=True) }}</tool_call>
    {% endfor %}
    {% endgeneration %}
  {% else %}
{{ message.content }}
  {% endif %}
<|im_end|>
  {% if ns.count > 50 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}{{ dict(n=tools | length) | tojson }}{% for t in tools %}{{ t | tojson(ensure_ascii=True) }}{% endfor %}{% endif %}
{{ strftime_now('%Y') | length }} {{ eos_token }}
{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tiny_dir() -> Path:
    return ensure_tiny_model()


@pytest.fixture(scope="module")
def sink_dir(tiny_dir: Path, tmp_path_factory) -> Path:
    """The tiny tokenizer with the kitchen-sink template inside tokenizer_config.json and a bos."""
    out = tmp_path_factory.mktemp("sink")
    shutil.copy(tiny_dir / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = KITCHEN_SINK
    config["bos_token"] = "<|endoftext|>"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def hf():
    from transformers import AutoTokenizer

    cache: dict[Path, object] = {}

    def load(path: Path):
        if path not in cache:
            cache[path] = AutoTokenizer.from_pretrained(str(path))
        return cache[path]

    return load


def reference(tok, messages, tools=None, add_generation_prompt=True):
    out = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True
    )
    ids = out["input_ids"] if not isinstance(out, list) else out  # transformers 5 returns a dict
    text = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False
    )
    return ids, text


CASES = {
    "single": (SINGLE, None),
    "single+tools": (SINGLE, TOOLS),
    "system": (WITH_SYSTEM, None),
    "multi-turn tool calls": (TOOL_TURNS, None),
    "multi-turn tool calls+tools": (TOOL_TURNS, TOOLS),
}


@pytest.mark.parametrize("model", ["tiny", "kitchen-sink"])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_ids_match_transformers(model, case, add_generation_prompt, tiny_dir, sink_dir, hf):
    path = tiny_dir if model == "tiny" else sink_dir
    messages, tools = CASES[case]
    template = ChatTemplate.from_model_dir(path)
    want_ids, want_text = reference(hf(path), messages, tools, add_generation_prompt)
    assert (
        template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt)
        == want_text
    )
    got = template.encode_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)
    assert got == want_ids
    assert template.decode(got) == want_text


def test_reasoning_alias_matches_transformers(sink_dir, hf):
    messages = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "a", "reasoning": "because"},
    ]
    template = ChatTemplate.from_model_dir(sink_dir)
    want_ids, want_text = reference(hf(sink_dir), messages)
    assert "<think>because</think>" in want_text
    assert template.encode_chat(messages) == want_ids


def test_message_objects_are_accepted(tiny_dir, hf):
    from openai.types.chat import ChatCompletionMessage

    reply = ChatCompletionMessage(role="assistant", content="hi there")
    messages = [{"role": "user", "content": "hi"}, reply, {"role": "user", "content": "again"}]
    template = ChatTemplate.from_model_dir(tiny_dir)
    plain = [messages[0], {"role": "assistant", "content": "hi there"}, messages[2]]
    assert template.encode_chat(messages) == reference(hf(tiny_dir), plain)[0]


def test_template_errors_are_raised(sink_dir):
    template = ChatTemplate.from_model_dir(sink_dir)
    with pytest.raises(jinja2.TemplateError, match="unknown role robot"):
        template.render([{"role": "robot", "content": "beep"}])
    with pytest.raises(ValueError, match="empty conversation"):
        template.render([])
    with pytest.raises(TypeError, match="JSON schemas"):
        template.render(SINGLE, tools=[len])


def test_tools_offered_to_a_template_that_ignores_them_are_refused(tiny_dir, tmp_path):
    # SmolLM2's template shape: ChatML that never reads `tools` (tests/test_real_model.py
    # runs the real one); the tools would be dropped without a word
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + "
        "'<|im_end|>\\n' }}{% endfor %}"
    )
    template = ChatTemplate.from_model_dir(tmp_path)
    assert not template.renders_tools()
    with pytest.raises(ToolsNotRendered, match="does not render tools"):
        template.encode_chat(SINGLE, tools=TOOLS)
    assert template.render(SINGLE, tools=[]) == template.render(SINGLE)
    assert ChatTemplate.from_model_dir(tiny_dir).renders_tools()


def test_sandbox_blocks_attribute_escapes(tiny_dir, tmp_path):
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    (tmp_path / "chat_template.jinja").write_text("{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        ChatTemplate.from_model_dir(tmp_path).render(SINGLE)


def test_template_sources_and_precedence(tiny_dir, tmp_path, hf):
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    config = json.loads((tiny_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [
        {"name": "default", "template": "D{{ messages[0].content }}"},
        {"name": "tool_use", "template": "T{{ tools | length }}{{ messages[0].content }}"},
    ]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_model_dir(tmp_path)
    tok = hf(tmp_path)
    assert template.render(SINGLE) == reference(tok, SINGLE)[1] == "DWhat is 2+3?"
    assert template.render(SINGLE, tools=TOOLS) == reference(tok, SINGLE, TOOLS)[1]
    assert template.render(SINGLE, tools=TOOLS).startswith("T2")
    # chat_template.jinja wins over tokenizer_config.json, as in transformers.
    (tmp_path / "chat_template.jinja").write_text("J{{ messages[0].content }}")
    assert ChatTemplate.from_model_dir(tmp_path).render(SINGLE) == "JWhat is 2+3?"


def test_tokens_and_eos(tiny_dir):
    template = ChatTemplate.from_model_dir(tiny_dir)
    # <|im_end|> from tokenizer_config.json, then <|endoftext|> from generation_config.json.
    assert template.eos_token_ids == [258, 256]
    assert template.special_tokens == {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    ids = template.encode("hi <|im_end|>")
    assert ids[-1] == 258
    assert template.decode(ids) == "hi <|im_end|>"
    assert template.decode(ids, skip_special_tokens=True) == "hi "


def test_missing_files_say_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"tokenizer\.json"):
        ChatTemplate.from_model_dir(tmp_path)


def test_import_pulls_in_neither_transformers_nor_torch():
    code = (
        "import sys, agentarium.formats.chat_template, agentarium.consumers.tracing.llm,"
        " agentarium.consumers.tracing.proxy;"
        "heavy = [m for m in ('transformers', 'torch') if m in sys.modules];"
        "assert not heavy, heavy"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def _random_texts(tokens: list[str], count: int, seed: int = 0) -> list[str]:
    """Texts mixing added tokens with what tokenizers treat specially around them: spaces and
    newlines on either side, a decomposed é (NFC), CJK, digits, contractions. Seeded
    (``random.Random``, the same texts on every machine): a test over them is deterministic,
    and it fails only on a text the encoder gets wrong."""
    import random

    rng = random.Random(seed)
    parts = [*tokens, " ", "  ", "\n", "\n\n", " \n", "\t", "e\u0301", "é", "你好", "12", "'s", "a"]
    parts += ["word", "<|im", "_end|>", "<", ">", "|"]  # pieces of tokens: never one by chance
    return ["".join(rng.choice(parts) for _ in range(rng.randint(0, 12))) for _ in range(count)]


def test_segment_encoder_matches_the_tokenizer(tiny_dir):
    """ChatTemplate.encode caches the text between added tokens: the same ids as encoding the
    whole text, for any text, and a template's fixed pieces are encoded once."""
    from agentarium.formats.chat_template import SegmentEncoder, load_tokenizer

    tokenizer = load_tokenizer(tiny_dir)
    encoder = SegmentEncoder(tokenizer)
    assert encoder.active
    tokens = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
    for text in _random_texts(tokens, 3000):
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids, text

    template = ChatTemplate.from_model_dir(tiny_dir)
    first = template.encode_chat([{"role": "user", "content": "repeat 1"}])
    pieces = set(template._segments._segments)
    second = template.encode_chat([{"role": "user", "content": "repeat 2"}])
    assert set(template._segments._segments) - pieces == {"user\nrepeat 2"}  # only the new one
    assert first != second and len(first) == len(second)


def test_segment_encoder_steps_aside_where_pieces_are_not_independent(tiny_dir):
    """Added tokens that swallow spaces, a pre-tokenizer that marks a text's first piece, or
    tokens added after the encoder was made: the tokenizer's own encode, the same ids."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    from agentarium.formats.chat_template import SegmentEncoder, load_tokenizer

    stripping = load_tokenizer(tiny_dir)
    stripping.add_tokens([AddedToken("<sep>", lstrip=True, rstrip=True, special=True)])
    metaspace = Tokenizer(models.WordLevel({"[UNK]": 0, "▁a": 1, "a": 2}, unk_token="[UNK]"))
    metaspace.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    metaspace.add_special_tokens(["<s>"])
    grown = load_tokenizer(tiny_dir)
    cases = [(stripping, False), (metaspace, False), (grown, True)]
    encoders = [(tok, SegmentEncoder(tok), active) for tok, active in cases]
    grown.add_tokens([AddedToken("<new>", special=True, normalized=False)])
    for tokenizer, encoder, active in encoders:
        assert encoder.active is active
        tokens = [t.content for t in tokenizer.get_added_tokens_decoder().values()]
        for text in _random_texts(tokens, 300, seed=1) + ["a<s>a", "x <sep> y", "a<new>b"]:
            assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids


def test_segment_cache_is_bounded(tiny_dir, monkeypatch):
    """The piece cache holds at most SEGMENT_BUDGET_CHARS of text, the oldest pieces out first;
    ids stay the tokenizer's."""
    from agentarium.formats import chat_template
    from agentarium.formats.chat_template import SegmentEncoder, load_tokenizer

    monkeypatch.setattr(chat_template, "SEGMENT_BUDGET_CHARS", 200)
    tokenizer = load_tokenizer(tiny_dir)
    encoder = SegmentEncoder(tokenizer)
    for i in range(100):
        text = f"<|im_start|>user\nmessage number {i}<|im_end|>\n"
        assert encoder.encode(text) == tokenizer.encode(text, add_special_tokens=False).ids
        assert encoder._chars == sum(map(len, encoder._segments)) <= 200
    assert "user\nmessage number 99" in encoder._segments
    assert "user\nmessage number 0" not in encoder._segments
