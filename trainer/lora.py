"""LoRA: train low-rank adapters on a frozen base model, publish only the adapters, merge them
for export.

With ``--lora-rank R`` the policy is the base model wrapped by ``peft`` (``LoraConfig``: rank,
``--lora-alpha``, ``--lora-target-modules``, no dropout, so the update stays reproducible);
its base weights are frozen, the optimizer holds only the adapters' parameters, and a checkpoint
holds both. What is published per version is the adapter alone (``AdapterExport``): one
safetensors file of the PEFT adapter state dict, its ``LoraConfig`` in the header metadata under
``inference.LORA_CONFIG_KEY``, so it travels through the same weight paths as whole weights (object
store or shared path) and the syncer can hand the engines a PEFT adapter directory
(``/load_lora_adapter``). ``merge_lora`` folds an adapter into its base model for export
(``agentarium merge-lora``).

A model trained elsewhere (TRL's ``GRPOTrainer`` with a ``peft_config``) publishes the same way:
``peft_adapter(model)`` is the ``AdapterExport`` of a peft LoRA model (None for a model without
peft), after checking that every tensor it holds is a LoRA A or B matrix, the only ones the
engines fold in.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

from agentarium.inference import LORA_CONFIG_KEY, adapter_directory

from .errors import TrainerConfigError

ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name
ALL_LINEAR = "all-linear"  # peft: every linear layer but the output head


def _peft():
    try:
        import peft
    except ImportError as exc:
        raise TrainerConfigError("--lora-rank needs peft: pip install 'agentarium[lora]'") from exc
    return peft


def _expert_modules(model) -> list[str]:
    """Names of a mixture of experts' expert blocks (Qwen3-MoE's, Mixtral's: their weights
    are 3-D parameters, one slice an expert, not linear layers)."""
    return [
        name
        for name, module in model.named_modules()
        if type(module).__name__.endswith("Experts") and name
    ]


def with_lora(model, *, rank: int, alpha: float, target_modules: tuple[str, ...]):
    """``model`` wrapped with fresh LoRA adapters (B = 0: the policy starts as the base).

    On a mixture of experts, ``all-linear`` leaves the experts' weights alone (peft would
    wrap their 3-D parameters, which no engine here folds in): the adapters train the linear
    layers outside them, the attention projections (transformers 5's routers are not linear
    layers either); naming the experts is refused."""
    peft = _peft()
    targets: str | list[str] = (
        ALL_LINEAR if tuple(target_modules) == (ALL_LINEAR,) else list(target_modules)
    )
    experts = _expert_modules(model)
    named = [t for t in target_modules if any(e.rsplit(".", 1)[-1] == t for e in experts)]
    if named:
        raise TrainerConfigError(
            f"--lora-target-modules {', '.join(named)}: LoRA on a mixture of experts' expert "
            "weights is not supported (they are 3-D parameters, one slice an expert, which the "
            "engines do not fold adapters into); target the attention and router layers, as "
            "all-linear does on such a model"
        )
    if experts and targets == ALL_LINEAR:
        # peft's all-linear would wrap the experts' (and the routers') parameters as well:
        # name the linear layers outside them instead, the output head aside, as all-linear does
        head = model.get_output_embeddings()
        targets = sorted(
            {
                name.rsplit(".", 1)[-1]
                for name, module in model.named_modules()
                if isinstance(module, torch.nn.Linear)
                and module is not head
                and not any(name.startswith(e + ".") for e in experts)
            }
        )
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none"
    )
    return peft.get_peft_model(model, config)


class AdapterExport:
    """What a LoRA trainer publishes: the adapter alone, saved as a model would be saved.
    ``adapter``: which of the peft model's adapters (peft's default name unless told)."""

    def __init__(self, model, adapter: str = "default") -> None:
        self.model = model
        self.adapter = adapter

    def __repr__(self) -> str:
        return f"<AdapterExport {self.adapter!r} of {type(self.model).__name__}>"

    def state(self) -> dict[str, torch.Tensor]:
        peft = _peft()
        # the adapters alone: no base weights (peft adds the output head's or the embeddings'
        # when they are targeted, in case their vocabulary was resized; ours never is)
        state = peft.get_peft_model_state_dict(
            self.model, adapter_name=self.adapter, save_embedding_layers=False
        )
        return {k: v.detach().to("cpu", torch.float32).contiguous() for k, v in state.items()}

    def config(self) -> dict[str, Any]:
        return self.model.peft_config[self.adapter].to_dict()

    def save_pretrained(self, directory: str | Path, **_: Any) -> Path:
        from safetensors.torch import save_file

        path = Path(directory) / ADAPTER_FILE
        text = json.dumps(self.config(), default=_plain, sort_keys=True)
        save_file(self.state(), str(path), metadata={"format": "pt", LORA_CONFIG_KEY: text})
        return path


def peft_adapter(model) -> AdapterExport | None:
    """What to publish of a peft LoRA model: its active adapter; None for a model without
    peft. TrainerConfigError for a peft model the engines could not serve as base + LoRA
    (another peft method; DoRA, a lora_B bias, ranks or alphas per module; tensors beside
    the A and B matrices: ``modules_to_save``, trained biases, trainable tokens), naming what
    to change."""
    if "peft" not in sys.modules:  # a peft model is an instance of a peft class
        return None
    peft = sys.modules["peft"]
    if not isinstance(model, peft.PeftModel):
        return None
    adapter = model.active_adapter
    config = model.peft_config[adapter]
    kind = str(getattr(config.peft_type, "value", config.peft_type))
    if kind != "LORA":
        raise TrainerConfigError(
            f"the model's adapter {adapter!r} is {kind}: the engines serve LoRA adapters only "
            "(peft.LoraConfig)"
        )
    unserved = {  # LoraConfig fields the engines' W + (alpha / r) B A does not follow
        "use_dora": "DoRA",
        "lora_bias": "a bias on lora_B",
        "rank_pattern": "ranks per module",
        "alpha_pattern": "alphas per module",
    }
    for field, what in unserved.items():
        if getattr(config, field, None):
            raise TrainerConfigError(
                f"the model's adapter {adapter!r} has {what} ({field}), which the engines do "
                f"not fold in: leave {field} unset in its LoraConfig"
            )
    export = AdapterExport(model, adapter)
    names = peft.get_peft_model_state_dict(
        model, adapter_name=adapter, save_embedding_layers=False
    ).keys()
    other = sorted(n for n in names if ".lora_A." not in n and ".lora_B." not in n)
    if other:
        raise TrainerConfigError(
            f"the model's adapter {adapter!r} holds {len(other)} tensors beside its LoRA A and "
            f"B matrices (first: {other[0]}), which the engines would not serve: drop "
            "modules_to_save, bias and trainable_token_indices from its LoraConfig"
        )
    return export


def merge_lora(model_dir: str | Path, adapter: str | Path, out: str | Path) -> Path:
    """The base model with the adapter folded in (W + alpha/r BA), saved to ``out`` with the
    base's tokenizer files: an ordinary transformers model directory to serve or share.
    ``adapter``: a published adapter file, or a PEFT adapter directory."""
    import tempfile

    from transformers import AutoModelForCausalLM

    peft = _peft()
    out = Path(out)
    base = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="agentarium-lora-") as tmp:
        source = Path(adapter)
        if source.is_file():
            source = adapter_directory(source, tmp)
        adapted = peft.PeftModel.from_pretrained(base, str(source))
        _untie_adapted_head(adapted)
        merged = adapted.merge_and_unload()
        merged.save_pretrained(str(out))
    for extra in Path(model_dir).iterdir():  # tokenizer, chat template, generation config
        weights = extra.suffix in (".safetensors", ".bin", ".pt") or extra.name.endswith(
            ".index.json"
        )
        if extra.is_file() and not weights and not (out / extra.name).exists():
            shutil.copyfile(extra, out / extra.name)
    return out


def _untie_adapted_head(adapted) -> None:
    """An adapter on a tied output head (``tie_word_embeddings``, SmolLM2's) adapts the head
    alone; merged into the shared weight it would change the input embedding too. The head gets
    a copy of its own first, and the exported config says it is untied."""
    model = adapted.get_base_model()
    head, embedding = model.get_output_embeddings(), model.get_input_embeddings()
    layer = getattr(head, "base_layer", None)  # peft's wrapper of an adapted head
    if layer is None or embedding is None or layer.weight is not embedding.weight:
        return
    layer.weight = torch.nn.Parameter(embedding.weight.detach().clone(), requires_grad=False)
    for config in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
        config.tie_word_embeddings = False


def _plain(value: Any) -> Any:
    """JSON for a LoraConfig's sets and enums."""
    if isinstance(value, set | frozenset | tuple):
        return sorted(value)
    return str(value)
