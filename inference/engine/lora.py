"""LoRA adapters on the local engine: SGLang's ``/load_lora_adapter`` and
``/unload_lora_adapter``, for one adapter at a time.

An adapter is a PEFT adapter directory (``adapter_config.json``, ``adapter_model.safetensors``:
what ``peft`` saves, and what the weight syncer makes of a LoRA trainer's published file). The
local engine folds it into the served weights, W + (alpha / r) B A for every adapted linear
layer (alpha / sqrt(r) with ``use_rslora``), keeping a copy of the base weights it changed, so
unloading (or loading the next version) restores the base exactly. A layer whose weight is
tied to another's (the output head of a model with ``tie_word_embeddings``: SmolLM2's
``lm_head`` is its input embedding) is untied while the adapter is in: it gets a weight of its
own, the base plus the delta, and the tie comes back on unload, so the adapter changes the head
alone, as PEFT's wrapped head does in the trainer, and never the input embedding. Unlike SGLang, which picks
an adapter per request and serves the base to requests that name none, the local engine
serves the loaded adapter to every request: it serves one policy. A request naming another
adapter (``lora_path``) is refused.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from .errors import WeightLoadError

_PREFIX = "base_model.model."  # PEFT's wrapper in adapter state-dict names


@dataclass
class Adapter:
    """One loaded adapter: its name, path and the weight deltas it adds, by parameter name."""

    name: str
    path: str
    deltas: dict[str, torch.Tensor]

    @classmethod
    def read(cls, name: str, path: str | Path) -> Adapter:
        directory = Path(path)
        try:
            config = json.loads((directory / "adapter_config.json").read_text())
            state = load_file(str(directory / "adapter_model.safetensors"))
        except (OSError, ValueError) as exc:
            raise WeightLoadError(
                f"lora_path {str(directory)!r} is not a PEFT adapter directory "
                f"(adapter_config.json and adapter_model.safetensors): {exc}"
            ) from exc
        rank = int(config.get("r") or 0)
        if rank < 1:
            raise WeightLoadError(f"adapter {name!r}: adapter_config.json has no rank r")
        alpha = float(config.get("lora_alpha") or rank)
        scale = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        deltas = {}
        for key, a in state.items():
            if ".lora_A." not in key:
                if ".lora_B." not in key:
                    raise WeightLoadError(
                        f"adapter {name!r}: {key} is not a LoRA A/B matrix of a linear layer "
                        "(the local engine folds those alone)"
                    )
                continue
            b = state.get(key.replace(".lora_A.", ".lora_B."))
            if b is None:
                raise WeightLoadError(f"adapter {name!r}: {key} has no lora_B")
            module = key.removeprefix(_PREFIX).split(".lora_A.")[0]
            deltas[f"{module}.weight"] = scale * (b.float() @ a.float())  # (out, in)
        return cls(name=name, path=str(directory), deltas=deltas)


@dataclass
class AdapterSlot:
    """The engine's one adapter slot: the adapter folded into the model, and the base tensors
    it replaced."""

    adapter: Adapter | None = None
    base: dict[str, torch.Tensor] = field(default_factory=dict)
    untied: dict[str, torch.nn.Parameter] = field(default_factory=dict)  # name: the tied one

    @property
    def name(self) -> str | None:
        return None if self.adapter is None else self.adapter.name

    def load(self, model: torch.nn.Module, adapter: Adapter) -> str:
        """Fold ``adapter`` in (after taking out the one loaded before, if any)."""
        params = _weights(model)
        for name, delta in adapter.deltas.items():
            if name not in params:
                raise WeightLoadError(
                    f"adapter {adapter.name!r} adapts {name}, which the served model does not have"
                )
            if tuple(delta.shape) != tuple(params[name].shape):
                raise WeightLoadError(
                    f"adapter {adapter.name!r}: {name} is {tuple(delta.shape)}, the served "
                    f"model's {tuple(params[name].shape)}"
                )
        self.unload(model)
        params, shared = _weights(model), _shared(model)  # ties restored by the unload
        with torch.no_grad():
            for name, delta in adapter.deltas.items():
                param = params[name]
                if name in shared:  # tied: a weight of its own, the shared one stays the base
                    module_name, _, attr = name.rpartition(".")
                    own = torch.nn.Parameter(
                        param.detach() + delta.to(param.dtype), requires_grad=param.requires_grad
                    )
                    setattr(model.get_submodule(module_name), attr, own)
                    self.untied[name] = param
                    continue
                self.base[name] = param.detach().clone()
                param.add_(delta.to(param.dtype))
        self.adapter = adapter
        return f"Succeeded to load LoRA adapter {adapter.name} ({len(adapter.deltas)} layers)."

    def unload(self, model: torch.nn.Module) -> str:
        """Restore the base weights the adapter changed, and the ties it undid."""
        params = _weights(model)
        with torch.no_grad():
            for name, tensor in self.base.items():
                params[name].copy_(tensor)
        unloaded = self.name
        self.forget(model)
        return f"Succeeded to unload LoRA adapter {unloaded}."

    def forget(self, model: torch.nn.Module) -> None:
        """Drop the adapter without restoring the weights it changed (new base weights were
        loaded over them), re-tying what it untied: a tied layer follows its new base again."""
        for name, param in self.untied.items():
            module_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(module_name), attr, param)
        self.adapter, self.base, self.untied = None, {}, {}


def _weights(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Every parameter by each of its names: a tied one under both (``named_parameters`` would
    name it once, by the module that comes first)."""
    return dict(model.named_parameters(remove_duplicate=False))


def _shared(model: torch.nn.Module) -> set[str]:
    """The names of parameters that more than one module holds (tied weights)."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name for group in names.values() if len(group) > 1 for name in group}
