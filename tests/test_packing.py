"""Packed rows (``--pack-rows``, trainer/packing.py) against padded ones: the same log-probs,
loss, statistics and gradient on the tiny model, with per-call temperatures, stale (tis)
tokens, the entropy bonus and the KL reference, chunked and whole-vocabulary, bare, with
activation checkpointing and with LoRA; micro-batches by a token budget add up to the same;
the decoder sees the real tokens and nothing else."""

from __future__ import annotations

import pytest
import torch
from test_logprob_chunks import TOL, V, assert_same_update, batch, update

from agentarium.tiny import ensure_tiny_model
from agentarium.trainer import packing
from agentarium.trainer.batch import Row, collate
from agentarium.trainer.logprobs import token_stats
from agentarium.trainer.step import StepSettings, load_model, load_policy, load_reference

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

torch.set_num_threads(1)
BASE = dict(kl_coef=0.1, entropy_coef=0.01, clip_low=0.1, clip_high=0.3)


@pytest.fixture(scope="module")
def tiny():
    return ensure_tiny_model()


def models(tiny, *, pack: bool, dtype: str = "float64", **settings):
    """Policy and a perturbed reference (so the KL term is not 0), as the trainer loads them."""
    step = StepSettings(dtype=dtype, pack_rows=pack, **settings)
    model = load_policy(tiny, "cpu", step)
    ref = load_reference(tiny, "cpu", step)
    with torch.no_grad():
        for p in ref.parameters():
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(1))
            p.add_(0.02 * noise.to(p.dtype))
    assert packing.enabled(model) == pack and packing.enabled(ref) == pack
    return model, ref


@pytest.mark.parametrize("chunk", [0, 7])
def test_packed_rows_give_the_padded_paths_loss_stats_and_gradient(tiny, chunk):
    """fp64, so the tolerance is test_logprob_chunks's (derived there): packing changes only
    the blocking of the linear layers' sums (N rows of work instead of b x T)."""
    padded = update(*models(tiny, pack=False), batch(), StepSettings(logprob_chunk=chunk, **BASE))
    model, ref = models(tiny, pack=True)
    packed = update(model, ref, batch(), StepSettings(logprob_chunk=chunk, **BASE))
    assert padded[1].kl > 1e-4 and padded[1].entropy > 0
    assert_same_update(padded, packed)
    # micro-batches by a token budget (a row longer than it alone) add up to the same
    budget = StepSettings(logprob_chunk=chunk, max_tokens_per_micro_batch=20, **BASE)
    assert_same_update(padded, update(model, ref, batch(), budget))


def test_log_probs_match_and_the_decoder_sees_real_tokens_only(tiny):
    data = batch()
    padded_model = load_model(tiny, "cpu", dtype="float64")
    model = load_model(tiny, "cpu", dtype="float64")
    packing.enable(model)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.append(tuple(args[0].shape))
    )
    with torch.no_grad():
        for chunk in (0, 5):
            want = token_stats(padded_model, data, chunk=chunk)
            got = token_stats(model, data, chunk=chunk)
            mask = data.loss_mask[:, 1:]
            torch.testing.assert_close(got.logprobs[mask], want.logprobs[mask], rtol=TOL, atol=TOL)
            torch.testing.assert_close(got.entropy[mask], want.entropy[mask], rtol=TOL, atol=TOL)
    hook.remove()
    assert seen == [(1, data.tokens)] * 2  # one sequence of the real tokens, no padding
    assert data.tokens < data.input_ids.numel()  # there was padding to skip


def test_fp32_packed_gradients_match_within_rounding(tiny):
    """fp32, as the trainer runs: each parameter's gradient within 1e-5 of its norm, the loss
    and statistics within 1e-5 relative. The fp64 test above bounds the paths' difference by
    rounding alone; in fp32 (u = 6e-8) that rounding over the longest chain (n < 600 terms,
    test_logprob_chunks) is at most 600 * 6e-8 = 3.6e-5 of a quantity's scale in the worst
    case and about sqrt(600) * 6e-8 = 1.5e-6 as errors of random sign add; norm-wise over a
    tensor the random case is what counts. Measured (default and AVX2 kernels, AVX-512 machine):
    gradients <= 2.5e-7 of their norm, the KL sum 5.3e-7 relative, the loss 6e-8.
    A parameter with no gradient in exact arithmetic (a key bias: softmax ignores a shift
    common to every key) has only rounding noise, so its norm is no scale: it is compared
    against the largest gradient's norm instead."""
    padded = update(*models(tiny, pack=False, dtype="float32"), batch(), StepSettings(**BASE))
    packed = update(*models(tiny, pack=True, dtype="float32"), batch(), StepSettings(**BASE))
    assert packed[0] == pytest.approx(padded[0], rel=1e-5)
    for name in ("tokens", "clipped", "kl", "entropy", "ratio"):
        assert getattr(packed[1], name) == pytest.approx(getattr(padded[1], name), rel=1e-5)
    scale = max(float(g.norm()) for g in padded[2].values())
    for name, grad in padded[2].items():
        norm = float(grad.norm())
        floor = scale if "k_proj.bias" in name else norm
        assert float((packed[2][name] - grad).norm()) <= 1e-5 * floor, name


def test_activation_checkpointing_and_lora_train_the_same_packed(tiny):
    pytest.importorskip("peft")
    plain = update(*models(tiny, pack=True), batch(), StepSettings(**BASE))
    model, ref = models(tiny, pack=True, activation_checkpointing=True)
    assert model.is_activation_checkpointing
    assert_same_update(plain, update(model, ref, batch(), StepSettings(**BASE)))
    lora = dict(lora_rank=4, lora_alpha=8, lora_target_modules=("all-linear",))
    results = []
    for pack in (False, True):
        torch.manual_seed(0)  # peft draws lora_A at random: the same draw for both
        model, _ = models(tiny, pack=pack, **lora)
        with torch.no_grad():  # B = 0 at the start: give the adapters a value to differentiate
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(2)))
        results.append(update(model, None, batch(), StepSettings(entropy_coef=0.01)))
    assert all("lora_" in name for name in results[0][2])
    assert_same_update(*results)


def rows_of(lengths: list[int]):
    return collate(
        [
            Row(
                input_ids=[1] * n,
                loss_mask=[0] + [1] * (n - 1),
                old_logprobs=[0.0] * n,
                temperature=[1.0] * n,
                advantage=1.0,
                tis=[0] * n,
                job_id=str(i),
            )
            for i, n in enumerate(lengths)
        ],
        pad_id=0,
    )


@pytest.mark.parametrize(
    ("size", "max_tokens", "packed", "passes"),
    [
        (0, 0, True, [[5, 30, 4, 4, 9]]),  # no limit: the whole batch
        (2, 0, True, [[5, 30], [4, 4], [9]]),  # rows
        (0, 12, True, [[5], [30], [4, 4], [9]]),  # real tokens; the 30-token row alone
        (0, 12, False, [[5], [30], [4, 4], [9]]),  # padded: [4, 4, 9] would cost 27
        (0, 18, True, [[5], [30], [4, 4, 9]]),  # 17 real tokens fit
        (0, 18, False, [[5], [30], [4, 4], [9]]),  # padded, 3 x 9 = 27 do not
        (2, 18, True, [[5], [30], [4, 4], [9]]),  # both limits
    ],
)
def test_micro_batches_by_rows_and_tokens(size, max_tokens, packed, passes):
    data = rows_of([5, 30, 4, 4, 9])
    got = [
        mb.attention_mask.sum(-1).tolist()
        for mb in data.micro_batches(size, max_tokens=max_tokens, packed=packed)
    ]
    assert got == passes


def test_a_model_with_a_sliding_window_stays_padded():
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, sliding_window=16,
    )  # fmt: skip
    model = MistralForCausalLM(config)
    assert not packing.supported(model)


def test_the_trainer_command_packs_by_default_and_takes_the_flags():
    from agentarium.cli import build_parser
    from agentarium.commands import trainer_cmd

    def resolved(*flags: str):
        args = build_parser().parse_args(
            ["trainer", "--run", "r", "--agent", "a", "--model", "tiny", *flags]
        )
        return trainer_cmd.resolve_args(args)[0]

    default = resolved()
    assert default.pack_rows and not default.activation_checkpointing
    assert default.max_tokens_per_micro_batch == 0
    off = resolved("--no-pack-rows", "--activation-checkpointing")
    assert not off.pack_rows and off.activation_checkpointing  # no --parallel fsdp needed now
    assert resolved("--max-tokens-per-micro-batch", "4096").max_tokens_per_micro_batch == 4096
    assert not resolved("pack_rows=false").pack_rows  # the config key, as an override
