"""GRPO math against hand-computed values: advantages, log-probs, clipped loss, k3 KL,
truncated IS weights, the three aggregations, and masks (no gradient from observations)."""

from __future__ import annotations

import math

import pytest
import torch

from agentarium.schemas import LLMCall, Trajectory
from agentarium.trainer.batch import Sample, advantages, build_rows, collate, refusal
from agentarium.trainer.grpo import (
    aggregate,
    clipped_surrogate,
    group_advantages,
    grpo_loss,
    k3_kl,
    token_entropy,
    token_logprobs,
    truncated_is_weights,
)

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

torch.set_num_threads(1)


def test_group_advantages_with_and_without_std():
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), eps=0.0)
    # mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735
    assert adv.tolist() == pytest.approx([0.866025, -0.866025, -0.866025, 0.866025], abs=1e-6)
    adv = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), eps=0.0)
    assert adv.tolist() == pytest.approx([-1.161895, -0.387298, 0.387298, 1.161895], abs=1e-6)
    raw = group_advantages(torch.tensor([1.0, 2.0, 3.0, 4.0]), std_norm=False)
    assert raw.tolist() == [-1.5, -0.5, 0.5, 1.5]
    assert group_advantages(torch.tensor([0.7, 0.7, 0.7])).tolist() == [0.0, 0.0, 0.0]
    assert advantages([0.0, 1.0], std_norm=False) == [-0.5, 0.5]


def test_token_logprobs_at_the_sampling_temperature():
    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # (1, 1, 2): probs 0.25, 0.75 at T = 1
    target = torch.tensor([[1]])
    assert token_logprobs(logits, target).item() == pytest.approx(math.log(0.75))
    # T = 2: logits / 2 -> probs proportional to 1 and sqrt(3)
    want = math.log(math.sqrt(3) / (1 + math.sqrt(3)))
    assert token_logprobs(logits, target, 2.0).item() == pytest.approx(want)
    assert token_logprobs(logits, target, torch.tensor([[2.0]])).item() == pytest.approx(want)


def test_clipped_surrogate_both_sides():
    ratios = torch.tensor([[1.5, 0.5, 0.5, 1.5, 1.1]])
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0, 1.0]])
    old = torch.zeros_like(ratios)
    logprobs = ratios.log().requires_grad_(True)
    loss, clipped, ratio = clipped_surrogate(logprobs, old, adv, clip_low=0.2, clip_high=0.28)
    # A>0, r=1.5 > 1.28: clipped high, -1.28; A>0, r=0.5: unclipped, -0.5;
    # A<0, r=0.5 < 0.8: clipped low, +0.8; A<0, r=1.5: unclipped, +1.5; A>0, r=1.1: -1.1.
    assert loss.tolist()[0] == pytest.approx([-1.28, -0.5, 0.8, 1.5, -1.1])
    assert clipped.tolist()[0] == [True, False, True, False, False]
    assert ratio.tolist()[0] == pytest.approx(ratios.tolist()[0])
    loss.sum().backward()
    # d(-r A)/d logp = -r A where unclipped, 0 where clipped
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, -0.5, 0.0, 1.5, -1.1])


def test_k3_kl_and_truncated_is_weights():
    lp = torch.tensor([[math.log(0.5), math.log(0.3)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.3)]])
    # exp(log .5) - log .5 - 1 = 0.5 + 0.693147 - 1
    assert k3_kl(lp, ref).tolist()[0] == pytest.approx([0.193147, 0.0], abs=1e-6)
    current = torch.tensor([[math.log(0.9), math.log(0.3)]])
    rollout = torch.tensor([[math.log(0.3), math.log(0.6)]])
    assert truncated_is_weights(current, rollout).tolist()[0] == pytest.approx([2.0, 0.5])
    assert truncated_is_weights(current, rollout, clip=5.0).tolist()[0] == pytest.approx([3.0, 0.5])


AGG_LOSS = torch.tensor([[1.0, 2.0, 3.0, 100.0], [6.0, 100.0, 100.0, 100.0], [100.0] * 4])
AGG_MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]])


@pytest.mark.parametrize(
    ("mode", "kwargs", "want"),
    [
        ("token-mean", {}, 12 / 4),  # (1 + 2 + 3 + 6) / 4 tokens
        ("seq-mean-token-mean", {}, (6 / 3 + 6 / 1) / 2),  # per-row means, then over 2 rows
        ("seq-mean-token-sum-norm", {"norm_tokens": 4}, (6 / 4 + 6 / 4) / 2),
        ("token-mean", {"total_tokens": 8}, 12 / 8),  # a shard of a bigger batch
        ("seq-mean-token-mean", {"total_seqs": 4}, (2 + 6) / 4),
    ],
)
def test_aggregations(mode, kwargs, want):
    assert aggregate(AGG_LOSS, AGG_MASK, mode, **kwargs).item() == pytest.approx(want)


def test_grpo_loss_adds_kl_and_ignores_masked_garbage():
    lp = torch.tensor([[math.log(0.5), -50.0]])
    old = torch.tensor([[math.log(0.5), 0.0]])  # ratio 1 on the real token
    ref = torch.tensor([[math.log(0.25), 40.0]])  # exp(40 + 50) overflows: must stay masked
    adv = torch.tensor([[2.0, 2.0]])
    mask = torch.tensor([[True, False]])
    loss, sums = grpo_loss(
        lp.requires_grad_(True),
        old,
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        ref_logprobs=ref,
        kl_coef=0.1,
    )
    assert loss.item() == pytest.approx(-2.0 + 0.1 * 0.193147, abs=1e-6)
    assert sums.tokens == 1 and sums.kl == pytest.approx(0.193147, abs=1e-6)
    loss.backward()
    assert torch.isfinite(lp.grad).all() and lp.grad[0, 1] == 0


def _call(prompt, response, logprobs, **kw) -> LLMCall:
    return LLMCall(
        prompt_ids=prompt,
        response_ids=response,
        response_logprobs=logprobs,
        finish_reason="stop",
        **kw,
    )


def _traj(calls, reward=1.0, job="j1", **kw) -> Trajectory:
    return Trajectory(
        job_id=job,
        agent="a",
        task_id="t",
        group_id="g",
        status="ok",
        reward=reward,
        calls=calls,
        **kw,
    )


def test_multi_turn_concat_masks_observations_and_falls_back_on_mismatch():
    first = _call([1, 2, 3], [4, 5], [-0.1, -0.2])
    # the second prompt extends the first prompt + response with observation tokens 6, 7
    second = _call([1, 2, 3, 4, 5, 6, 7], [8], [-0.3], temperature=0.7)
    rows, stats = build_rows([Sample(_traj([first, second]), 0.5)])
    assert stats.concatenated == 1 and stats.prefix_mismatches == 0 and len(rows) == 1
    row = rows[0]
    assert row.input_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    assert row.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert row.old_logprobs == pytest.approx([0, 0, 0, -0.1, -0.2, 0, 0, -0.3])
    assert row.temperature == pytest.approx([1, 1, 1, 1, 1, 1, 1, 0.7])
    # a re-rendered history (token 5 became 9) cannot be concatenated: one row per call
    other = _call([1, 2, 3, 4, 9, 6, 7], [8], [-0.3])
    rows, stats = build_rows([Sample(_traj([first, other]), 0.5)])
    assert stats.prefix_mismatches == 1 and len(rows) == 2
    rows, stats = build_rows([Sample(_traj([first, second]), 0.5)], multi_turn="per-call")
    assert len(rows) == 2 and stats.concatenated == 0


def test_observation_tokens_contribute_no_gradient():
    first = _call([1, 2, 3], [4, 5], [-1.0, -1.2])
    second = _call([1, 2, 3, 4, 5, 6, 7], [8], [-0.9])
    rows, _ = build_rows([Sample(_traj([first, second]), 1.0)])
    batch = collate(rows, pad_id=0)
    logits = torch.randn(
        1, batch.input_ids.shape[1], 10, generator=torch.Generator().manual_seed(0)
    )
    logits.requires_grad_(True)
    lp = token_logprobs(logits[:, :-1], batch.input_ids[:, 1:], batch.temperature[:, 1:])
    loss, _ = grpo_loss(
        lp,
        batch.old_logprobs[:, 1:],
        batch.advantages[:, 1:],
        batch.loss_mask[:, 1:],
        clip_low=0.2,
        clip_high=0.2,
    )
    loss.backward()
    per_position = logits.grad.abs().sum(-1)[0]  # (T,): position t predicts token t + 1
    predicts_model_token = batch.loss_mask[0, 1:].tolist() + [False]
    for t, is_model in enumerate(predicts_model_token):
        assert (per_position[t] > 0) == is_model, (t, per_position.tolist())


def test_unreproducible_sampling_is_refused():
    assert refusal(_traj([_call([1], [2], [-1.0])])) is None
    assert "top_p=0.9" in refusal(_traj([_call([1], [2], [-1.0], top_p=0.9)]))
    assert "top_k=20" in refusal(_traj([_call([1], [2], [-1.0], top_k=20)]))
    assert "greedy" in refusal(_traj([_call([1], [2], [-1.0], temperature=0.0)]))
    with pytest.raises(AssertionError, match="cannot be reproduced"):
        build_rows([Sample(_traj([_call([1], [2], [-1.0], top_p=0.5)]), 1.0)])


def test_micro_batches_and_shards_add_up_to_the_whole_batch(tmp_path):
    from agentarium.tiny import ensure_tiny_model
    from agentarium.trainer.step import StepSettings, Totals, forward_backward, load_model

    model = load_model(ensure_tiny_model(), "cpu")
    samples = [
        Sample(
            _traj(
                [
                    _call(
                        [257, 10 + i, 11, 12], [48 + i, 258][: 1 + i % 2], [-2.0, -1.5][: 1 + i % 2]
                    )
                ],
                job=f"j{i}",
            ),
            advantage=(-1) ** i * 0.5 * (i + 1),
        )
        for i in range(5)
    ]
    batch = collate(build_rows(samples)[0], pad_id=256)
    totals = Totals.of(batch)

    def grads(settings, parts):
        model.zero_grad(set_to_none=True)
        loss = 0.0
        for part in parts:
            loss += forward_backward(model, None, part, settings, totals, "cpu")[0]
        return loss, [p.grad.clone() for p in model.parameters()]

    # bf16 autocast: the same loss and gradient up to bf16 rounding, and fp32 gradients.
    # The loss sees the log-probs (-5.4 to -6.0 here, old ones -1.5 and -2.0) only through the
    # unclipped ratios r = exp(lp - old) <= exp(-3.4) = 0.033 of the A > 0 tokens (A < 0 ones
    # are clipped at 0.8, a constant): |dloss/dlp_t| <= |A_t| r_t / 7, summed (0.5 + 1.5 + 2.5)
    # * 0.033 / 7 = 0.021. bf16 keeps 8 significant bits (u = 2**-8); first order, 15 matmuls
    # on the path, two rounded operands each, and log-softmax's factor 2: a log-prob is off by
    # <= 2 * 15 * 2u = 0.23 (1.6e-3 measured). So |dloss| <= 0.021 * (exp(0.23) - 1) = 5.5e-3
    # (1.0e-5 measured, both kernel sets); the old guess was 0.05.
    fp32 = grads(StepSettings(), [batch])
    bf16 = grads(StepSettings(bf16_autocast=True), [batch])
    assert bf16[0] == pytest.approx(fp32[0], abs=5.5e-3)
    assert all(g.dtype == torch.float32 for g in bf16[1])
    cosine = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in fp32[1]]), torch.cat([g.flatten() for g in bf16[1]]), dim=0
    )
    assert cosine > 0.95

    # The parts against the whole in float64: they differ only in the order of their sums, each
    # of n < 600 terms (matmul widths <= 263, 7 loss tokens), so by at most n * 2**-53 = 7e-14
    # of the scale (loss 0.12-0.67, gradient entries <= 0.036); measured <= 5.6e-17 on the loss
    # and 2.8e-17 on gradients (both kernel sets). 1e-10 leaves three orders; a part counted
    # twice, dropped or normalised by its own token count moves them by >= 1e-3. (In fp32 they
    # differed by up to 6e-8 and 1e-8, against a guessed atol=1e-6, rtol=1e-4.)
    model = load_model(ensure_tiny_model(), "cpu", dtype="float64")  # grads() reads this one
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        whole = grads(StepSettings(loss_agg=agg, loss_norm_tokens=8), [batch])
        micro = grads(StepSettings(loss_agg=agg, loss_norm_tokens=8, micro_batch_size=2), [batch])
        sharded = grads(StepSettings(loss_agg=agg, loss_norm_tokens=8), batch.shards(2))
        for other in (micro, sharded):
            assert other[0] == pytest.approx(whole[0], abs=1e-10)
            for a, b in zip(whole[1], other[1], strict=True):
                assert a.dtype == torch.float64
                torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_entropy_bonus_lowers_the_loss_by_coef_times_mean_entropy():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, requires_grad=True)
    targets = torch.tensor([[1, 2, 3], [0, 4, 1]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]], dtype=torch.bool)
    logprobs = token_logprobs(logits, targets, 1.0)
    entropy = token_entropy(logits, 1.0)
    adv = torch.tensor([[0.5] * 3, [-0.5] * 3])
    base, _ = grpo_loss(logprobs, logprobs.detach(), adv, mask, clip_low=0.2, clip_high=0.2)
    bonus, _ = grpo_loss(
        logprobs,
        logprobs.detach(),
        adv,
        mask,
        clip_low=0.2,
        clip_high=0.2,
        entropy=entropy,
        entropy_coef=0.1,
    )
    expected = base - 0.1 * entropy[mask].mean()
    assert torch.allclose(bonus, expected, atol=1e-6)
    # the bonus pushes toward higher entropy: its gradient on the logits is not zero
    (grad,) = torch.autograd.grad(bonus - base, logits)
    assert grad[mask].abs().sum() > 0 and grad[~mask].abs().sum() == 0


def test_dual_clip_caps_the_loss_of_negative_advantages_at_c():
    # verl's compute_policy_loss_vanilla: for A < 0, min(max(-A r, -A clip(r)), -A c), c = 3
    ratios = torch.tensor([[10.0, 2.0, 10.0, 10.0]])
    adv = torch.tensor([[-1.0, -1.0, 1.0, -0.5]])
    logprobs = ratios.log().requires_grad_(True)
    loss, clipped, _ = clipped_surrogate(
        logprobs, torch.zeros_like(ratios), adv, clip_low=0.2, clip_high=0.2
    )
    # r = 10, A = -1: capped at 3 (was 10); r = 2 < c: unchanged; A > 0: the upper clip as
    # before; A = -0.5: 0.5 * 3
    assert loss.tolist()[0] == pytest.approx([3.0, 2.0, -1.2, 1.5])
    assert clipped.tolist()[0] == [True, False, True, True]
    loss.sum().backward()
    assert logprobs.grad.tolist()[0] == pytest.approx([0.0, 2.0, 0.0, 0.0])
    # a different c, and off (0 or None): the unbounded PPO loss
    five, _, _ = clipped_surrogate(
        ratios.log(), torch.zeros_like(ratios), adv, clip_low=0.2, clip_high=0.2, dual_clip=5.0
    )
    assert five.tolist()[0][0] == pytest.approx(5.0)
    for off in (0.0, None):
        raw, _, _ = clipped_surrogate(
            ratios.log(), torch.zeros_like(ratios), adv, clip_low=0.2, clip_high=0.2, dual_clip=off
        )
        assert raw.tolist()[0] == pytest.approx([10.0, 2.0, -1.2, 5.0])
    # grpo_loss passes it through
    mask = torch.ones_like(ratios, dtype=torch.bool)
    total, _ = grpo_loss(
        ratios.log(), torch.zeros_like(ratios), adv, mask, clip_low=0.2, clip_high=0.2
    )
    assert total.item() == pytest.approx((3.0 + 2.0 - 1.2 + 1.5) / 4)


def test_log_ratio_is_clamped_to_20_before_exp():
    # verl clamps logp - logp_old to [-20, 20]: exp(29.9) = 9.7e12 becomes exp(20) = 4.9e8
    logprobs = torch.tensor([[29.9, -29.9]])
    adv = torch.tensor([[-1.0, 1.0]])
    _, _, ratio = clipped_surrogate(
        logprobs, torch.zeros_like(logprobs), adv, clip_low=0.2, clip_high=0.2
    )
    assert ratio.tolist()[0] == pytest.approx([math.exp(20.0), math.exp(-20.0)])
    loss, _, _ = clipped_surrogate(
        logprobs, torch.zeros_like(logprobs), adv, clip_low=0.2, clip_high=0.2, dual_clip=None
    )
    assert loss.tolist()[0][0] == pytest.approx(math.exp(20.0))


def test_a_flat_group_has_zero_advantages_whatever_eps():
    for eps in (0.0, 1e-6):
        for rewards in ([0.5, 0.5, 0.5], [0.7, 0.7, 0.7], [1.0]):
            adv = group_advantages(torch.tensor(rewards, dtype=torch.float64), eps=eps)
            assert adv.tolist() == [0.0] * len(rewards), (eps, rewards)
            assert advantages(rewards, eps=eps) == [0.0] * len(rewards)
    # eps = 0 is the exact z-score elsewhere
    assert advantages([0.0, 1.0], eps=0.0) == pytest.approx([-0.707107, 0.707107], abs=1e-6)


def test_rewards_stay_float64_until_the_advantages():
    # float32 has a spacing of 8 at 1e8: these three rewards would all round to 1e8 (a flat
    # group, advantages 0); in float64 they are -1, 0, 1 standard deviations
    assert advantages([1e8, 1e8 + 1, 1e8 + 2]) == pytest.approx([-1.0, 0.0, 1.0], abs=1e-5)
    assert advantages([0.1, 0.1 + 1e-9], std_norm=False) == pytest.approx([-5e-10, 5e-10])


def test_dual_clip_is_a_trainer_flag_that_can_be_turned_off():
    import argparse

    from agentarium.commands.trainer_cmd import add_trainer_arguments, config_from_args
    from agentarium.tiny import ensure_tiny_model
    from agentarium.trainer.config import TrainerConfig
    from agentarium.trainer.errors import TrainerConfigError
    from agentarium.trainer.step import StepSettings

    parser = argparse.ArgumentParser()
    add_trainer_arguments(parser)
    base = ["--run", "r", "--agent", "a", "--model", str(ensure_tiny_model())]
    assert config_from_args(parser.parse_args(base)).dual_clip == 3.0
    cfg = config_from_args(parser.parse_args([*base, "--dual-clip", "5"]))
    assert StepSettings.from_config(cfg).dual_clip == 5.0
    assert config_from_args(parser.parse_args([*base, "--dual-clip", "none"])).dual_clip == 0
    with pytest.raises(TrainerConfigError, match="--dual-clip must be > 1"):
        TrainerConfig(run="r", agent="a", model_dir=str(ensure_tiny_model()), dual_clip=0.5)


def test_one_torch_free_rows_module_serves_trainer_tensorize_and_export():
    import importlib
    import subprocess
    import sys

    import agentarium.evaluation.export
    import agentarium.trainer.batch
    from agentarium import trainer
    from agentarium.trainer import pad_token_id, rows_of

    # trajectory -> rows lives once, in trainer/rows.py; agentarium reaches it through `trainer`
    tensorize_module = importlib.import_module("agentarium.orchestrator.tensorize")
    assert tensorize_module.rows_of is rows_of
    assert agentarium.evaluation.export.rows_of is rows_of
    assert trainer.batch.rows_of is rows_of and "rows_of" in trainer.__all__
    code = "import sys, agentarium.trainer; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]
    # the trainer's rows and the verl batch's rows are the same tokens, mask and log-probs
    first = _call([1, 2, 3], [4, 5], [-0.1, -0.2])
    second = _call([1, 2, 3, 4, 5, 6, 7], [8], [-0.3], temperature=0.7)
    for calls in ([first, second], [first, _call([1, 2, 3, 4, 9, 6, 7], [8], [-0.3])]):
        traj = _traj(calls)
        shared, _ = rows_of(traj)
        built, _ = build_rows([Sample(traj, 0.5)])
        assert [r.input_ids for r in built] == [r.input_ids for r in shared]
        assert [r.loss_mask for r in built] == [r.loss_mask for r in shared]
        assert [r.old_logprobs for r in built] == [r.old_logprobs for r in shared]
        assert [r.temperature for r in built] == [r.temperature for r in shared]
    # one pad-id rule: the pad token, else the first eos, else 0
    assert pad_token_id(7, [3, 4]) == 7 and pad_token_id(None, [3, 4]) == 3
    assert pad_token_id(None, 5) == 5 and pad_token_id(None, None) == 0
    assert pad_token_id(0, [3]) == 0
