"""The built-in tiny model: written once, deterministic, a standard transformers directory."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import jinja2
import pytest
from agentlib import add_tool

from agentarium.tiny import (
    IM_END_ID,
    IM_START_ID,
    TINY_NAME,
    VOCAB_SIZE,
    ensure_tiny_model,
    resolve_model,
)

MESSAGES = [
    {"role": "system", "content": "Add numbers."},
    {"role": "user", "content": "What is 12+30?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call-1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 12, "b": 30}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call-1", "content": "42"},
]
TOOLS = [add_tool("Add two numbers.", ("a",))]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("home"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_written_once_under_home(tmp_path):
    path = ensure_tiny_model(tmp_path)
    assert path == tmp_path / "models" / TINY_NAME
    names = {p.name for p in path.iterdir()}
    assert {
        "config.json",
        "model.safetensors",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    } <= names
    mtime = (path / "model.safetensors").stat().st_mtime_ns
    assert ensure_tiny_model(tmp_path) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == mtime
    assert [p.name for p in path.parent.iterdir()] == [TINY_NAME]  # no temp dirs left


def test_same_bytes_in_every_build(tmp_path, tiny):
    import transformers  # noqa: F401  (warm the import so the timing is the build's)

    started = time.perf_counter()
    other = ensure_tiny_model(tmp_path / "other-home")
    assert time.perf_counter() - started < 10.0  # built in code, nothing fetched or trained
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert _sha256(other / name) == _sha256(tiny / name), name


def test_concurrent_builders_agree(tmp_path):
    paths: list[Path] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            paths.append(ensure_tiny_model(tmp_path))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert len(set(paths)) == 1
    assert [p.name for p in paths[0].parent.iterdir()] == [TINY_NAME]


def test_config_is_small_and_untied(tiny):
    config = json.loads((tiny / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]
    assert config["tie_word_embeddings"] is False
    assert config["vocab_size"] == VOCAB_SIZE < 512
    assert config["num_hidden_layers"] == 2
    assert config["num_attention_heads"] == 4 and config["num_key_value_heads"] == 2


def test_loads_with_transformers_untied(tiny):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    assert model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr()
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


def test_tokenizer_one_token_per_character(tiny):
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny)
    raw = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert len(hf) == VOCAB_SIZE
    assert hf.eos_token == "<|im_end|>" and hf.pad_token == "<|endoftext|>"
    for text in ("0123456789", "abcXYZ", " \n", "12+34=46.", "(a, b): [c]!?"):
        ids = hf(text)["input_ids"]
        assert len(ids) == len(text), text
        assert raw.encode(text).ids == ids
        assert hf.decode(ids) == text
    assert [hf.convert_ids_to_tokens(i) for i in hf("7")["input_ids"]] == ["7"]
    text = "héllo ✓ <tool_call>x</tool_call><|im_end|>"
    assert raw.decode(raw.encode(text).ids, skip_special_tokens=False) == text
    # tool tokens survive skip_special_tokens (calls are parsed from the text), ChatML's do not
    ids = raw.encode("<tool_call>{}</tool_call><|im_end|>").ids
    assert raw.decode(ids, skip_special_tokens=True) == "<tool_call>{}</tool_call>"


def test_chat_template_with_tools(tiny):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny)
    text = hf.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    assert text.startswith("<|im_start|>system\nAdd numbers.\n\n# Tools\n")
    assert '"name": "add"' in text.split("\n</tools>")[0]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 30}}\n</tool_call>' in text
    assert "<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    encoded = hf.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
    assert ids[0] == IM_START_ID and IM_END_ID in ids
    assert hf.convert_tokens_to_ids("<tool_response>") in ids


def test_chat_template_readable_without_transformers(tiny):
    from transformers import AutoTokenizer

    config = json.loads((tiny / "tokenizer_config.json").read_text())
    assert config["chat_template"] == (tiny / "chat_template.jinja").read_text()
    assert config["eos_token"] == "<|im_end|>" and config["pad_token"] == "<|endoftext|>"
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    rendered = (
        jinja2.Environment()
        .from_string(config["chat_template"])
        .render(messages=messages, add_generation_prompt=False)
    )
    expected = AutoTokenizer.from_pretrained(tiny).apply_chat_template(messages, tokenize=False)
    assert rendered == expected
    assert rendered.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")


def test_resolve_model(tmp_path, monkeypatch, tiny):
    monkeypatch.setenv("AGENTARIUM_HOME", str(tmp_path))
    assert resolve_model("tiny") == tmp_path / "models" / TINY_NAME
    assert resolve_model(str(tiny)) == tiny.resolve()
    with pytest.raises(ValueError, match="pass 'tiny'"):
        resolve_model(str(tmp_path / "nowhere"))
    with pytest.raises(ValueError, match="config.json"):
        resolve_model(str(tmp_path))
