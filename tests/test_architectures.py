"""The architectures beyond the tiny Qwen2 (agentarium/tiny_families.py: Llama, Qwen3 with q/k
norms, Qwen3-MoE and Mixtral mixtures of experts, Mistral's and Gemma 3's sliding windows), each
a random-weight model built from its config: the local engine serves it, and the trainer's
log-probs of what it sampled equal the engine's; the trainer packs its rows where the attention
allows (padded and packed agree) and pads them where it does not; LoRA trains it, leaving a
mixture's experts alone, and naming them is a clear error."""

from __future__ import annotations

import pytest
import torch

from agentarium.inference.engine import LocalEngine
from agentarium.tiny_families import ARCHITECTURES, ensure_tiny_architecture
from agentarium.trainer import packing
from agentarium.trainer.batch import Row, collate
from agentarium.trainer.errors import TrainerConfigError
from agentarium.trainer.logprobs import token_stats
from agentarium.trainer.step import StepSettings, load_model, load_policy

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

torch.set_num_threads(1)
PROMPT = list(b"The weather in Paris, then Rome:")
PACKED = {"llama", "qwen3", "qwen3_moe", "mixtral"}  # plain causal attention
PADDED = {"mistral", "gemma3"}  # a sliding window


def test_every_architecture_is_classed():
    assert PACKED | PADDED == set(ARCHITECTURES) and not PACKED & PADDED


def rows_of(sequences: list[list[int]], prompt: int):
    return collate(
        [
            Row(
                input_ids=ids,
                loss_mask=[int(t >= prompt) for t in range(len(ids))],
                old_logprobs=[0.0] * len(ids),
                temperature=[1.0] * len(ids),
                advantage=1.0,
                tis=[0] * len(ids),
                job_id=str(i),
            )
            for i, ids in enumerate(sequences)
        ],
        pad_id=0,
    )


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
async def test_the_engine_and_the_trainer_agree_on_what_was_sampled(arch):
    """fp32 both sides, the same products summed in other orders (a KV cache against the
    whole sequence, packed rows against one): per log-prob ~ (matmuls on the path, <= 20 with
    the router's) x sqrt(K <= 128) x u (6e-8) x sum|W h| (<= 3 at these weights' scale),
    doubled by log-softmax and by the two computations: 20 x 11.3 x 6e-8 x 3 x 4 = 1.6e-4 at
    the probabilistic bound; the issue's bar, 1e-4, sits below it and far above what is
    measured: <= 4.8e-7 (one ulp at these log-probs' size) for every architecture, on the
    default (AVX-512) and AVX2 kernels. What it guards, a position, a cache slot or an expert
    routed otherwise, moves a log-prob by far more."""
    model_dir = ensure_tiny_architecture(arch)
    async with LocalEngine(model_dir) as engine:
        out = await engine.generate(
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5},
                "return_logprob": True,
            }
        )
    sampled = out["output_ids"]
    assert sampled, out
    served = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    policy = load_policy(model_dir, "cpu", StepSettings())
    assert packing.enabled(policy) == (arch in PACKED)
    batch = rows_of([PROMPT + sampled, PROMPT[:9]], len(PROMPT))  # a second row: padding
    with torch.no_grad():
        trained = token_stats(policy, batch, chunk=512).logprobs[0, len(PROMPT) - 1 :]
    assert float((trained[: len(sampled)] - served).abs().max()) <= 1e-4


@pytest.mark.parametrize("arch", sorted(PACKED))
def test_packed_rows_equal_padded_ones(arch):
    """fp64, where the paths differ only in how sums are blocked (tests/test_packing.py's
    bound, 1e-10); the mixtures' grouped expert products have no fp64 kernel, so they compare
    in fp32 to the engine test's bound (1e-4; the same derivation)."""
    model_dir = ensure_tiny_architecture(arch)
    moe = arch in ("qwen3_moe", "mixtral")
    dtype, tol = ("float32", 1e-4) if moe else ("float64", 1e-10)
    padded = load_model(model_dir, "cpu", trainable=False, dtype=dtype)
    packed = load_model(model_dir, "cpu", trainable=False, dtype=dtype)
    packing.enable(packed)
    g = torch.Generator().manual_seed(1)
    batch = rows_of([torch.randint(0, 256, (n,), generator=g).tolist() for n in (20, 7, 13)], 4)
    with torch.no_grad():
        want = token_stats(padded, batch, chunk=8).logprobs
        got = token_stats(packed, batch, chunk=8).logprobs
    mask = batch.loss_mask[:, 1:]
    torch.testing.assert_close(got[mask], want[mask], rtol=0, atol=tol)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_lora_trains_each_and_leaves_a_mixtures_experts_alone(arch):
    pytest.importorskip("peft")
    from agentarium.trainer.lora import with_lora

    model_dir = ensure_tiny_architecture(arch)
    lora = with_lora(load_model(model_dir, "cpu"), rank=4, alpha=8, target_modules=("all-linear",))
    adapted = {n.rsplit(".", 1)[-1] for n, m in lora.named_modules() if hasattr(m, "lora_A")}
    assert {"q_proj", "k_proj", "v_proj", "o_proj"} <= adapted
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    moe = arch in ("qwen3_moe", "mixtral")
    assert not any("experts" in n for n in trainable)
    assert ("down_proj" in adapted) == (not moe)  # a dense MLP's layers are adapted
    if moe:
        with pytest.raises(TrainerConfigError, match="expert weights is not supported"):
            with_lora(load_model(model_dir, "cpu"), rank=4, alpha=8, target_modules=("experts",))


def test_the_trainer_packs_only_models_whose_attention_allows_it():
    from agentarium.trainer.config import TrainerConfig

    for arch in ARCHITECTURES:
        config = TrainerConfig(run="r", agent="a", model_dir=str(ensure_tiny_architecture(arch)))
        assert config.pack_rows and StepSettings.from_config(config).pack_rows == (arch in PACKED)
