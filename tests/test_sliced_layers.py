"""--layer-chunk (trainer/sliced_layers.py): a long pass's decoder layers run a slice of
positions at a time, every second layer's input kept, and train exactly as the whole layers."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from updatelib import BASE, assert_same_update, batch, update

from agentarium.tiny import ensure_tiny_model
from agentarium.tiny_families import ensure_tiny_architecture
from agentarium.trainer import sliced_layers
from agentarium.trainer.step import StepSettings, load_model, load_policy, load_reference

CHUNK = 7  # updatelib's batch is one pass of 90 positions: 13 slices, rows split across them


def _rms_norm_fp64(self, hidden):  # type: ignore[no-untyped-def]
    variance = hidden.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden * torch.rsqrt(variance + self.variance_epsilon))


@pytest.fixture
def norms_in_fp64(monkeypatch):
    """transformers' RMSNorm computes in fp32 whatever the model's dtype. A sliced layer sends
    the queries' gradient and the keys' and values' back through its input norm separately,
    where the whole layer sums them first: two fp32 roundings against one (measured: 1.5e-8
    on the input's gradient of an fp64 layer). Kept in fp64 (the same formula), the paths
    compared differ only in the order of fp64 additions, which updatelib's tolerance bounds."""
    for family, name in (("llama", "Llama"), ("qwen2", "Qwen2"), ("qwen3", "Qwen3")):
        module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        monkeypatch.setattr(getattr(module, f"{name}RMSNorm"), "forward", _rms_norm_fp64)


def policy_and_reference(model_dir, settings: StepSettings):
    torch.manual_seed(0)  # LoRA's adapters start random: the same ones in both
    model = load_policy(model_dir, "cpu", settings)
    ref = load_reference(model_dir, "cpu", settings)
    with torch.no_grad():  # a reference other than the policy: the KL term not 0
        for p in ref.parameters():
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
            p.add_(0.02 * noise.to(p.dtype))
    return model, ref


def widest_projection(model) -> list[int]:  # type: ignore[no-untyped-def]
    """Records the positions every linear layer of the decoder layers is given."""
    widths: list[int] = []
    for layer in sliced_layers.decoder_layers(model):
        for module in layer.modules():
            if isinstance(module, torch.nn.Linear):
                module.register_forward_hook(
                    lambda _m, args, _out: widths.append(args[0].shape[-2])
                )
    return widths


@pytest.mark.kernels  # gradients compared: run again under ATEN_CPU_CAPABILITY=avx2
@pytest.mark.parametrize(
    "family,extra",
    [
        ("qwen2", {}),
        ("qwen2", {"share_prefix": True}),  # rows after a shared prefix read its keys
        ("llama", {}),
        ("qwen3", {}),  # normed keys (k_norm) before the rotary embedding
        ("qwen2", {"lora_rank": 4}),  # the adapters' gradients alone
    ],
)
def test_sliced_layers_train_as_the_whole_layers(norms_in_fp64, monkeypatch, family, extra):
    """fp64, under activation checkpointing: the loss, statistics and every gradient of a pass
    whose layers run ``CHUNK`` positions at a time are the whole layers' (updatelib's
    tolerance: the same sums in another order), and no projection of a decoder layer ever sees
    more than ``CHUNK`` positions, in the forward pass or the backward."""
    model_dir = ensure_tiny_model() if family == "qwen2" else ensure_tiny_architecture(family)
    data = batch()
    whole_settings = StepSettings(dtype="float64", activation_checkpointing=True, **BASE, **extra)
    whole = update(*policy_and_reference(model_dir, whole_settings), data, whole_settings)
    sliced_settings = dataclasses.replace(whole_settings, layer_chunk=CHUNK)
    model, ref = policy_and_reference(model_dir, sliced_settings)
    widths = widest_projection(model)
    rebuilt: list[int] = []  # inputs not kept, run again from the block's first
    input_of = sliced_layers._Block.input_of
    monkeypatch.setattr(
        sliced_layers._Block,
        "input_of",
        lambda block, index: rebuilt.append(index) or input_of(block, index),
    )
    sliced = update(model, ref, data, sliced_settings)
    assert_same_update(whole, sliced)
    assert data.tokens > 4 * CHUNK and widths and max(widths) == CHUNK
    assert rebuilt == [1]  # two layers, one block: the second's input was not kept


def test_freed_memory_goes_back_after_each_sliced_layers_forward_and_backward():
    """``--heap release``: the pages a long layer freed are handed back before the next layer
    allocates (a sliced layer's slices free and allocate in other sizes than the next's)."""
    settings = StepSettings(activation_checkpointing=True, layer_chunk=CHUNK, heap="default")
    model, ref = policy_and_reference(ensure_tiny_model(), settings)
    released: list[int] = []
    layers = sliced_layers.enable(model, CHUNK, lambda: released.append(1))
    update(model, ref, batch(), settings)  # one pass
    assert layers == 2 and len(released) == 2 * layers


def test_a_layer_whose_input_has_no_gradient_runs_under_plain_checkpointing():
    """Its backward would never run, and the weights' gradients are added in it."""
    plain: list[torch.Tensor] = []
    slicer = sliced_layers.Slicer(4, lambda forward, *args: plain.append(args[0]) or forward(*args))
    hidden = torch.ones(1, 9, 8)
    with torch.enable_grad():
        out = slicer(0, lambda h: h + 1, hidden)
    assert plain and plain[0] is hidden and torch.equal(out, hidden + 1)


def test_only_exact_models_run_sliced():
    """A mixture of experts (routing balanced over the whole pass), a model without packed
    rows, or a chunk of 0: nothing changes."""
    settings = StepSettings(activation_checkpointing=True)
    moe = load_policy(ensure_tiny_architecture("qwen3_moe"), "cpu", settings)
    assert sliced_layers.enable(moe, 4) == 0
    tiny = ensure_tiny_model()
    unpacked = load_policy(tiny, "cpu", dataclasses.replace(settings, pack_rows=False))
    assert sliced_layers.enable(unpacked, 4) == 0
    dense = load_policy(tiny, "cpu", settings)
    assert sliced_layers.enable(dense, 0) == 0
    assert sliced_layers.enable(dense, 4) == dense.config.num_hidden_layers
    plain = load_model(tiny, "cpu")  # no checkpointing: no checkpointed layers to slice
    assert sliced_layers.enable(plain, 4) == 0
