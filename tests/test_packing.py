"""Packed rows (``--pack-rows``, trainer/packing.py) against padded ones: the same log-probs,
loss, statistics and gradient on the tiny model, with per-call temperatures, stale (tis)
tokens, the entropy bonus and the KL reference, chunked and whole-vocabulary, bare, with
activation checkpointing and with LoRA; micro-batches by a token budget add up to the same;
the decoder sees the real tokens and nothing else."""

from __future__ import annotations

import pytest
import torch
from updatelib import BASE, TOL, V, assert_same_update, batch, five_row, update

from agentarium.tiny import ensure_tiny_model
from agentarium.trainer import packing
from agentarium.trainer.batch import Batch, Row, collate
from agentarium.trainer.logprobs import token_stats
from agentarium.trainer.step import StepSettings, load_model, load_policy, load_reference

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

torch.set_num_threads(1)


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
    """fp64, so the tolerance is updatelib's (derived there): packing changes only
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
    updatelib's TOL) is at most 600 * 6e-8 = 3.6e-5 of a quantity's scale in the worst
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


def group_batch(shared_response: int = 0) -> Batch:
    """A GRPO group's shape: five rows with one 20-token prompt and different responses (the
    first ``shared_response`` response tokens the same in every row, loss tokens in the
    shared prefix then), per-call temperatures, an observation, stale tokens, as ``batch``."""
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(0, 256, (20,), generator=g).tolist()
    common = torch.randint(0, 256, (shared_response,), generator=g).tolist()
    rows = []
    for i in range(5):
        response = common + torch.randint(0, 256, (3 + 2 * i,), generator=g).tolist()
        at = len(response) - 3  # an observation inside the response (row 3)
        rows.append(five_row(i, prompt, response, observation_at=at, stale=2, job_id=f"g{i}"))
    return collate(rows, pad_id=256)


def assert_same_to_fp32_rounding(padded, shared, tol: float = TOL) -> None:
    """The loss and statistics within ``tol`` (the forward passes are the same sums), each
    gradient within 1e-5 of its norm. transformers' RMSNorm computes in fp32 even in an fp64
    model; the shared prefix's gradient is the rows' sum before it goes back through the norms,
    where the padded path takes each row's back alone and sums after, so the two round
    differently there: fp32's u = 6e-8 per operation, on contributions as large as the sum
    (measured: 9e-8 of the largest gradient; 1e-5 is the fp32 test's bound above). A parameter
    with no gradient in exact arithmetic (a key bias) is compared against the largest norm."""
    assert shared[0] == pytest.approx(padded[0], rel=tol, abs=tol)
    for name in ("tokens", "clipped", "kl", "entropy", "ratio"):
        assert getattr(shared[1], name) == pytest.approx(getattr(padded[1], name), rel=tol), name
    assert shared[2].keys() == padded[2].keys() and padded[2]
    scale = max(float(g.norm()) for g in padded[2].values())
    for name, grad in padded[2].items():
        floor = scale if "k_proj.bias" in name else float(grad.norm())
        assert float((shared[2][name] - grad).norm()) <= 1e-5 * floor, name


@pytest.mark.parametrize("shared_response", [0, 3])
@pytest.mark.parametrize("chunk", [0, 7])
def test_a_shared_prefix_runs_once_and_trains_as_the_padded_rows(tiny, chunk, shared_response):
    """fp64: the prompt every row begins with (and, with ``shared_response``, loss tokens every
    row shares too) runs once a pass; the loss and statistics are the padded path's to fp64's
    tolerance (above), the gradients to fp32 rounding (``assert_same_to_fp32_rounding``); the
    unshared packed path stays fp64-exact, and a token budget's passes share too."""
    data = group_batch(shared_response)
    prefix = 20 + shared_response
    assert (
        packing.pack(data.input_ids, data.attention_mask, share_prefix=True).prefix_of
        == [prefix] * 5
    )
    settings = StepSettings(logprob_chunk=chunk, **BASE)
    padded = update(*models(tiny, pack=False), data, settings)
    model, ref = models(tiny, pack=True)
    seen = []
    hook = model.get_input_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.append(tuple(args[0].shape))
    )
    shared = update(model, ref, data, settings)
    hook.remove()
    assert seen == [(1, data.tokens - 4 * prefix)]  # the prefix once, not five times
    assert_same_to_fp32_rounding(padded, shared)
    unshared = StepSettings(logprob_chunk=chunk, share_prefix=False, **BASE)
    assert_same_update(padded, update(model, ref, data, unshared))
    budget = StepSettings(logprob_chunk=chunk, max_tokens_per_micro_batch=40, **BASE)
    passes = list(data.micro_batches(0, max_tokens=40, packed=True, share_prefix=True))
    assert 1 < len(passes) < data.rows  # the budget splits the rows, each pass shares
    assert_same_to_fp32_rounding(padded, update(model, ref, data, budget))


def test_fp32_shared_prefix_gradients_match_within_rounding(tiny):
    """fp32, as the trainer runs, with the bounds of the fp32 packed test above."""
    data = group_batch(3)
    padded = update(*models(tiny, pack=False, dtype="float32"), data, StepSettings(**BASE))
    shared = update(*models(tiny, pack=True, dtype="float32"), data, StepSettings(**BASE))
    assert_same_to_fp32_rounding(padded, shared, tol=1e-5)


def test_a_short_common_prefix_is_not_shared():
    data = rows_of([20, 20, 20])  # every token the same: 20 in common
    assert (
        packing.pack(data.input_ids, data.attention_mask, share_prefix=True).prefix_of == [20] * 3
    )
    ids = data.input_ids.clone()
    ids[1, packing.MIN_SHARED_PREFIX - 1] = 2  # one token short of the minimum
    short = packing.pack(ids, data.attention_mask, share_prefix=True)
    assert short.prefix_of == [0, 0, 0] and short.tokens == 60  # row 1 parts at 15 from both
    assert packing.pack(data.input_ids, data.attention_mask).prefix_of == [0, 0, 0]  # not asked
    one = rows_of([20])
    assert packing.pack(one.input_ids, one.attention_mask, share_prefix=True).prefix_of == [0]


def two_groups(system: int, prompt: int) -> Batch:
    """Two groups of three rows: a ``system``-token start every row has, then each group's own
    ``prompt`` tokens, then each row's own 4 response tokens."""
    lengths = [system + prompt + 4] * 6
    data = rows_of(lengths)
    g = torch.Generator().manual_seed(7)
    data.input_ids[:, :system] = torch.randint(0, 256, (system,), generator=g)
    for group in range(2):
        data.input_ids[3 * group : 3 * group + 3, system : system + prompt] = torch.randint(
            0, 256, (prompt,), generator=g
        )
    data.input_ids[:, system + prompt :] = torch.randint(0, 256, (6, 4), generator=g)
    return data


def test_each_group_shares_its_own_prompt_in_one_pass(tiny):
    """Two groups in one pass, each a run with its prompt; a start every row has (a system
    prompt) is not worth merging the runs for; the log-probs are the padded path's."""
    data = two_groups(20, 30)
    packed = packing.pack(data.input_ids, data.attention_mask, share_prefix=True)
    assert packed.prefix_of == [50] * 6  # each group's 50, not every row's 20
    assert packed.tokens == 2 * 50 + 6 * 4
    assert [mb.rows for mb in data.micro_batches(0, max_tokens=75, packed=True, share_prefix=True)] == [3, 3]  # fmt: skip
    padded_model = load_model(tiny, "cpu", dtype="float64")
    model = load_model(tiny, "cpu", dtype="float64")
    packing.enable(model)
    mask = data.loss_mask[:, 1:]
    with torch.no_grad():
        for chunk in (0, 5):
            want = token_stats(padded_model, data, chunk=chunk).logprobs[mask]
            got = token_stats(model, data, chunk=chunk).logprobs[mask]
            torch.testing.assert_close(got, want, rtol=TOL, atol=TOL)
    # groups whose prompts share most of their tokens (few-shot examples, then the question)
    # make one run: 8 rows sharing 45 save more than each group's 48
    close = two_groups(45, 3)
    assert (
        packing.pack(close.input_ids, close.attention_mask, share_prefix=True).prefix_of == [45] * 6
    )


@pytest.mark.parametrize(
    ("max_tokens", "share", "passes"),
    [
        (60, False, [[30, 30], [40]]),  # 100 real tokens: 60 hold two rows
        (60, True, [[30, 30, 40]]),  # 25 shared: 25 + 5 + 5 + 15 = 50
        (45, True, [[30, 30], [40]]),  # 25 + 5 + 5 = 35; the third would make 50
    ],
)
def test_a_token_budget_counts_a_shared_prefix_once(max_tokens, share, passes):
    data = rows_of([30, 30, 40])
    data.input_ids[:, 25:] = torch.arange(3)[:, None] + 2  # the rows part at token 25
    got = [
        mb.attention_mask.sum(-1).tolist()
        for mb in data.micro_batches(0, max_tokens=max_tokens, packed=True, share_prefix=share)
    ]
    assert got == passes


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
    assert default.pack_rows and default.share_prefix and not default.activation_checkpointing
    assert not resolved("--no-share-prefix").share_prefix
    assert not resolved("share_prefix=false").share_prefix
    assert default.max_tokens_per_micro_batch == 0
    off = resolved("--no-pack-rows", "--activation-checkpointing")
    assert not off.pack_rows and off.activation_checkpointing  # no --parallel fsdp needed now
    assert resolved("--max-tokens-per-micro-batch", "4096").max_tokens_per_micro_batch == 4096
    assert not resolved("pack_rows=false").pack_rows  # the config key, as an override
