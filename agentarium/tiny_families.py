"""Random-weight models of the architectures agentic-RL users train, tiny, built from configs.

As the built-in tiny model is (agentarium/tiny.py), each is a standard transformers model
directory written once under ``$AGENTARIUM_HOME/models/tiny-<arch>-v1/`` from a fixed seed,
nothing downloaded: the tiny model's byte-level tokenizer (token id == byte; its special tokens
the ChatML ones), a ``config.json`` of the architecture at a small size, and the chat template
of the architecture's family (formats/families.py). What each architecture brings:

- ``llama``: Llama 3 (the Llama 3 template, JSON tool calls);
- ``qwen3``: Qwen3, with its per-head q/k RMS norms (the Qwen3 template: think blocks, Hermes);
- ``qwen3_moe``: Qwen3-MoE, every layer a mixture of 4 experts, 2 per token;
- ``mixtral``: Mixtral-style mixture of experts (the Mistral template);
- ``mistral``: Mistral, with its sliding-window attention (the Mistral template);
- ``gemma3``: Gemma 3's text model, sliding-window and global layers, q/k norms and scaled
  embeddings (the Qwen3 template: the family format is not what is tested of it).

``ensure_tiny_architecture(arch)`` returns the directory. The model is the tokenizer's size
(263 tokens), hidden 64, 2 layers, 4 heads and 2 key-value heads.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from agentarium.formats import FAMILIES

from .models import build_once, models_dir
from .tiny import (
    ENDOFTEXT_ID,
    IM_END_ID,
    SEED,
    VOCAB_SIZE,
    _tokenizer_config,
    build_tokenizer,
)

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "bos_token_id": ENDOFTEXT_ID,
    "eos_token_id": IM_END_ID,
    "pad_token_id": ENDOFTEXT_ID,
}
_MOE = {"num_experts_per_tok": 2, "moe_intermediate_size": 64}

# architecture -> (transformers config class, model class, its own config values, family)
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any], str]] = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, "llama3"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}, "qwen3"),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {"head_dim": 16, "num_experts": 4, "decoder_sparse_step": 1, **_MOE},
        "qwen3",
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {"num_local_experts": 4, "num_experts_per_tok": 2},
        "mistral",
    ),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}, "mistral"),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "head_dim": 16,
            "sliding_window": 64,
            "layer_types": ["sliding_attention", "full_attention"],
        },
        "qwen3",
    ),
}


def ensure_tiny_architecture(arch: str, home: Path | None = None) -> Path:
    """The directory of the tiny ``arch`` model (``ARCHITECTURES``), built first if needed."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}: one of {', '.join(ARCHITECTURES)}")
    return build_once(
        models_dir(home) / f"tiny-{arch.replace('_', '-')}-v1", lambda out: _write(arch, out)
    )


def _write(arch: str, out: Path) -> None:
    import torch
    import transformers
    from transformers import GenerationConfig

    config_name, model_name, own, family = ARCHITECTURES[arch]
    config = getattr(transformers, config_name)(**{**_COMMON, **own})
    config.architectures = [model_name]
    torch.manual_seed(SEED)
    model = getattr(transformers, model_name)(config)
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():  # our own init: the bytes do not depend on transformers' draw order
        for name, param in sorted(model.named_parameters()):
            if "norm" in name:
                param.fill_(0.0 if arch == "gemma3" else 1.0)  # Gemma scales by 1 + weight
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    model.generation_config = GenerationConfig(
        bos_token_id=ENDOFTEXT_ID, eos_token_id=[IM_END_ID], pad_token_id=ENDOFTEXT_ID
    )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a build's progress bars are noise in a service's log
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save(str(out / "tokenizer.json"))
    template = FAMILIES[family].template
    tokenizer_config = {**_tokenizer_config(), "chat_template": template}
    (out / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(
        json.dumps({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}, indent=2) + "\n"
    )
    (out / "chat_template.jinja").write_text(template)
