"""The built-in tiny model: a Qwen2 causal LM small enough to run the whole loop on a laptop CPU.

`ensure_tiny_model()` writes it once to `$AGENTARIUM_HOME/models/tiny-v1/` (default
`~/.cache/agentarium`) and returns that directory, a standard transformers model directory:
config.json, model.safetensors, generation_config.json, tokenizer.json, tokenizer_config.json
and chat_template.jinja. Nothing is downloaded: the weights come from a fixed seed and the
tokenizer is built in code, so every build writes the same bytes.

The tokenizer is byte-level BPE with no merges, Qwen2's pre-tokenizer pipeline and 256 byte
tokens (token id == byte value, so every digit, letter, space and newline is one token), plus
the ChatML and Hermes tool-call tokens. The chat template is Qwen2.5's, with tool support.

The cached path imports nothing heavy; torch and transformers load only when a build is needed.
`resolve_model` (agentarium/models.py, re-exported here) is the one place the word "tiny" means
anything.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .models import agentarium_home as agentarium_home  # re-exported: older imports
from .models import build_once, models_dir
from .models import resolve_model as resolve_model

TINY_NAME = "tiny-v1"
SEED = 20240917

# id == byte value for the 256 byte tokens; specials follow in this order.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen2.5 marks its tool tokens non-special, so skip_special_tokens keeps them in decoded text
# and tool calls can be parsed from it.
TOOL_TOKENS = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>")
VOCAB_SIZE = 256 + len(SPECIAL_TOKENS) + len(TOOL_TOKENS)  # 263
ENDOFTEXT_ID, IM_START_ID, IM_END_ID = 256, 257, 258

# Byte-level prompts are long (one token per character), and Qwen2.5's tool system prompt alone
# is ~600 bytes: 2048 positions leave room for a tool-using conversation. RoPE has no learned
# position table, so the length costs nothing until it is used.
# Qwen2Config keyword arguments (values of several types: a plain dict[str, Any]).
MODEL_CONFIG: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}

# Qwen2's pre-tokenizer split (Qwen2Tokenizer in transformers 5 rebuilds exactly this pipeline).
_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

# Qwen2.5's template; two departures: a shorter default system prompt (byte-level tokens make
# every character count) and tool-call arguments that are already a JSON string (the OpenAI
# shape) are emitted as-is instead of being JSON-encoded a second time.
CHAT_TEMPLATE = (
    """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- '"""
    + DEFAULT_SYSTEM_PROMPT
    + """' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\n"""
    + DEFAULT_SYSTEM_PROMPT
    + """<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + (message.content or '') + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {%- if tool_call.arguments is string %}
                {{- tool_call.arguments }}
            {%- else %}
                {{- tool_call.arguments | tojson }}
            {%- endif %}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
)


def ensure_tiny_model(home: Path | None = None) -> Path:
    """Return the tiny model's directory, building it first if it is not there yet (safe
    under concurrency: ``models.build_once``)."""
    return build_once(models_dir(home) / TINY_NAME, _write_tiny_model)


def build_tokenizer():
    """The tiny model's `tokenizers.Tokenizer`, built in code (no download)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        normalizers,
        pre_tokenizers,
        processors,
    )
    from tokenizers.models import BPE

    vocab = {char: byte for byte, char in _bytes_to_unicode().items()}
    tok = Tokenizer(BPE(vocab=vocab, merges=[], fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TOOL_TOKENS])
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    assert tok.token_to_id("<|im_end|>") == IM_END_ID
    return tok


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table, as byte-level BPE vocabularies spell bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    printable += range(ord("®"), ord("ÿ") + 1)
    table: dict[int, str] = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _tokenizer_config() -> dict:
    added = {}
    for i, text in enumerate(SPECIAL_TOKENS + TOOL_TOKENS):
        added[str(256 + i)] = {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": text in SPECIAL_TOKENS,
        }
    return {
        # Not Qwen2Tokenizer: the generic class loads tokenizer.json exactly as written.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "model_max_length": MODEL_CONFIG["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "add_prefix_space": False,
        "chat_template": CHAT_TEMPLATE,
    }


def _write_tiny_model(out: Path) -> None:
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers.utils import logging as hf_logging

    config = Qwen2Config(**MODEL_CONFIG)
    config.architectures = ["Qwen2ForCausalLM"]
    model = Qwen2ForCausalLM(config)
    # Our own init rather than transformers': the bytes then do not depend on the order in
    # which a transformers version happens to draw its random numbers.
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * config.initializer_range)
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID,
        eos_token_id=[IM_END_ID, ENDOFTEXT_ID],
        pad_token_id=ENDOFTEXT_ID,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
    )
    bars_were_off = hf_logging.is_progress_bar_enabled() is False
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(out, safe_serialization=True)
    finally:
        if not bars_were_off:
            hf_logging.enable_progress_bar()
    build_tokenizer().save(str(out / "tokenizer.json"))
    tokenizer_config = json.dumps(_tokenizer_config(), indent=2, sort_keys=True)
    (out / "tokenizer_config.json").write_text(tokenizer_config + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n"
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
