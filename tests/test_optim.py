"""AdamW with smaller moments (``--optimizer-state fp8``, trainer/optim.py): its rounding is
unbiased, its first step is AdamW's, its moments follow fp32 AdamW's where rounding to nearest
would stick, and a trainer holds 3 bytes a parameter, saves, resumes and refuses the other
kind by name."""

from __future__ import annotations

import math

import pytest
import torch

from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.errors import TrainerConfigError
from agentarium.trainer.optim import (
    BLOCK,
    FP8,
    Fp8AdamW,
    bound,
    decode,
    draws,
    encode,
    stochastic_bf16,
    stochastic_fp8,
)
from agentarium.trainer.step import LocalUpdater, memory_of

N = 1 << 20  # draws a statistical check averages over


def fp8_values(codes: torch.Tensor) -> torch.Tensor:
    return codes.view(FP8).to(torch.float32)


@pytest.mark.parametrize("x", [1.1, -1.1, 300.0, 0.0371, -0.0171, 2.0**-8 + 2.0**-11])
def test_stochastic_rounding_lands_on_a_neighbouring_code_and_is_unbiased(x):
    """Each result is one of the two codes around x. False-failure rate: the mean of N
    Bernoulli choices between codes lo and hi has sd at most (hi - lo) / (2 sqrt N); the bound
    allowed is 6 sd (two-sided P < 2e-9) plus the draws' discreteness, 2^-16 of (hi - lo), and,
    below 2^-6 where the cast rounds to nearest, half of e4m3's 2^-9 spacing there."""
    torch.manual_seed(0)
    values = torch.full((N,), x)
    codes = fp8_values(stochastic_fp8(values, draws(N, values.device)[0]))
    table = torch.arange(256, dtype=torch.uint8).view(FP8).to(torch.float32)
    table = table[~table.isnan()].double()
    lo, hi = float(table[table <= x].max()), float(table[table >= x].min())  # x's neighbours
    assert set(codes.unique().tolist()) <= {lo, hi}, codes.unique()
    spacing = hi - lo
    allowed = 6 * spacing / (2 * math.sqrt(N)) + spacing * 2.0**-16
    if abs(x) < 2.0**-6:
        allowed = 2.0**-10
    assert abs(float(codes.double().mean()) - x) <= allowed


def test_stochastic_bfloat16_rounding_is_unbiased():
    """False-failure rate: as above, 6 sd of a mean of N choices between two neighbours; the
    bfloat16 draws are exactly the 16 bits it drops, so no discreteness term."""
    torch.manual_seed(4)
    for x in (1.0 + 2.0**-9, -3.3e-7, 0.77):
        values = torch.full((N,), x)
        rounded = stochastic_bf16(values, draws(N, values.device)[1]).double()
        lo, hi = float(rounded.min()), float(rounded.max())
        assert lo <= x <= hi and len(rounded.unique()) <= 2
        assert abs(float(rounded.mean()) - x) <= 6 * (hi - lo) / (2 * math.sqrt(N))


def test_the_two_draws_are_uniform_and_independent():
    """False-failure rate: each check is a mean or a correlation of N uniform draws, allowed 6
    sd (P < 2e-9 each)."""
    torch.manual_seed(1)
    fp8, bf16 = draws(N, torch.device("cpu"))
    assert bool(((fp8 - 8) % 16 == 0).all()) and int(fp8.min()) >= 8 and int(fp8.max()) < 2**20
    assert int(bf16.min()) >= 0 and int(bf16.max()) < 2**16
    low, high = (fp8.double() - 8) / 2.0**20, bf16.double() / 2.0**16
    for d in (low, high):
        assert abs(float(d.mean()) - 0.5) < 6 * math.sqrt(1 / 12 / N)
    correlation = float(((low - 0.5) * (high - 0.5)).mean()) * 12
    assert abs(correlation) < 6 / math.sqrt(N)


def test_every_value_decodes_within_one_code_of_itself_and_a_zero_block_to_zeros():
    torch.manual_seed(2)
    values = torch.randn(64 * BLOCK) * torch.logspace(-3, 3, 64).repeat_interleave(BLOCK)
    values[5 * BLOCK : 6 * BLOCK] = 0
    codes = torch.zeros(values.numel(), dtype=torch.uint8)
    scales = torch.zeros(64)
    encode(values.clone(), codes, scales, draws(values.numel(), values.device)[0])
    back = decode(codes, scales)
    blocks = values.view(-1, BLOCK)
    # the block's largest magnitude maps to 448, e4m3's largest code
    largest = blocks.abs().amax(dim=1)
    assert torch.allclose(scales[largest > 0] * 448, largest[largest > 0], rtol=1e-6)
    # within one code: 2^-3 of the value in e4m3's normal range, 2^-9 of the scale below it
    scale = scales[:, None]
    assert bool(
        (
            (back - values).abs().view(-1, BLOCK)
            <= (2.0**-3 * blocks.abs() + 2.0**-9 * scale) * (1 + 1e-6)
        ).all()
    )
    assert not bool(back[5 * BLOCK : 6 * BLOCK].any())


def test_the_update_clamp_is_the_largest_ratio_adam_reaches():
    """``bound`` is reached by the Cauchy-Schwarz extreme (gradients g_(t-k) = (b1/b2)^k) and
    no random gradient sequence passes it."""
    b1, b2 = 0.9, 0.999
    for t in (1, 2, 10, 1000):
        extreme = torch.tensor([(b1 / b2) ** (t - 1 - i) for i in range(t)], dtype=torch.float64)
        ratios = [ratio(extreme, b1, b2)]
        gen = torch.Generator().manual_seed(t)
        ratios += [
            ratio(torch.randn(t, generator=gen, dtype=torch.float64), b1, b2) for _ in range(50)
        ]
        assert max(ratios) == pytest.approx(bound(b1, b2, t), rel=1e-9)
        assert ratios[0] == pytest.approx(bound(b1, b2, t), rel=1e-9)


def ratio(grads: torch.Tensor, b1: float, b2: float) -> float:
    """|m̂ / sqrt(v̂)| of exact Adam after the gradients ``grads`` (oldest first)."""
    m = v = 0.0
    for g in grads.tolist():
        m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    t = grads.numel()
    return abs(m / (1 - b1**t)) / math.sqrt(v / (1 - b2**t))


def test_the_first_step_is_adamws_and_the_moments_then_follow_fp32_adamw():
    """The first step decodes zero moments exactly and steps on the fp32 ones before storing
    them, so it is AdamW's up to the order of a few fp32 roundings (each 2^-24 of the update,
    lr at most, plus the weight's own rounding)."""
    torch.manual_seed(3)
    start = torch.randn(N)
    lr, betas, wd = 1e-2, (0.9, 0.999), 0.1
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    grad = torch.randn(N)
    ours.grad, theirs.grad = grad.clone(), grad.clone()
    Fp8AdamW([ours], lr=lr, betas=betas, weight_decay=wd).step()
    torch.optim.AdamW([theirs], lr=lr, betas=betas, weight_decay=wd).step()
    assert float((start - theirs.detach()).abs().max()) > 0.9 * lr  # it moved
    assert bool(((ours - theirs).abs() <= 8 * 2.0**-24 * lr + 2.0**-23 * start.abs()).all())


def test_the_moments_follow_a_constant_gradient_where_rounding_to_nearest_sticks():
    """300 steps of a constant gradient c (0.5 <= c <= 1, varying within each block), whose
    moments are m = c (1 - b1^t) and sqrt(v) = c sqrt(1 - b2^t). After about 150 steps a step
    moves sqrt(v) by less than half a bfloat16 code, so rounded to nearest it stays put (23 %
    low at step 300: computed below); rounded stochastically its mean over N values stays on
    the exact one.

    Bounds and false-failure rate: each step's rounding error of a value is mean-zero with sd at
    most half a code (2^-8 relative in bfloat16, 2^-4 in e4m3), and a later step keeps at most
    all of it (factors b2 and b1 below 1), so the mean over N values after 300 steps has sd at
    most sqrt(300) 2^-8 / sqrt(N) = 6.6e-5 for the root and sqrt(1 / (1 - 0.81)) 2^-4 / sqrt(N)
    = 1.4e-4 for m; 6 sd each (P < 2e-9). The root's square also carries a bias: E[r^2] exceeds
    r^2 by the rounding's variance, at most 2^-16 of v a step, 300 steps: 2.3e-3 of the root."""
    torch.manual_seed(5)
    b1, b2 = 0.9, 0.999
    c = torch.rand(N) * 0.5 + 0.5
    p = torch.nn.Parameter(torch.zeros(N))
    optimizer = Fp8AdamW([p], lr=0.0, betas=(b1, b2))
    nearest = torch.zeros(N, dtype=torch.bfloat16)
    for _ in range(300):
        p.grad = c.clone()
        optimizer.step()
        nearest = (b2 * nearest.float() ** 2 + (1 - b2) * c * c).sqrt().to(torch.bfloat16)
    state = optimizer.state[p]
    root = state["exp_avg_sq_root"][:N].double() / (c * math.sqrt(1 - b2**300))
    mean = decode(state["exp_avg"], state["exp_avg_scale"])[:N].double() / (c * (1 - b1**300))
    assert abs(float(root.mean()) - 1) < 6 * 6.6e-5 + 2.3e-3
    assert abs(float(mean.mean()) - 1) < 6 * 1.4e-4
    stuck = float((nearest.double() / (c * math.sqrt(1 - b2**300))).mean())
    assert stuck < 0.8  # what the test tells apart: to nearest, the root stopped growing


def test_the_rounding_depends_on_the_steps_seed_not_on_what_was_drawn_before():
    """Data-parallel ranks seed each step alike but draw differently in their forward passes:
    their moments must round alike, or their replicas drift apart."""
    params = []
    for drawn_before in (0, 12345):
        torch.manual_seed(11)  # the trainer's per-step seed
        torch.rand(drawn_before)  # a forward pass's draws (dropout, sampling)
        p = torch.nn.Parameter(torch.linspace(-1, 1, 4 * BLOCK))
        p.grad = torch.linspace(0.3, -0.7, 4 * BLOCK)
        Fp8AdamW([p], lr=1e-2).step()
        p.grad = torch.linspace(-0.2, 0.9, 4 * BLOCK)
        torch.manual_seed(12)
        torch.rand(drawn_before)
        optimizer = Fp8AdamW([p], lr=1e-2)
        optimizer.step()
        optimizer.step()
        params.append(p.detach().clone())
    assert torch.equal(params[0], params[1])


def test_released_gradients_leave_the_step_the_same_and_a_chunk_smaller_than_a_parameter():
    """``release_grads`` drops each gradient once its update is taken (the trainer zeroes them
    after the step anyway): the same parameters and moments, bit for bit, chunks of 2 blocks
    over parameters of 5 and 1 blocks included."""
    results = []
    for release in (False, True):
        torch.manual_seed(3)
        params = [torch.nn.Parameter(torch.linspace(-1, 1, 5 * BLOCK)),
                  torch.nn.Parameter(torch.linspace(2, 0, BLOCK - 7))]  # fmt: skip
        optimizer = Fp8AdamW(params, lr=1e-2, chunk=2 * BLOCK, release_grads=release)
        for step in range(3):
            for i, p in enumerate(params):
                p.grad = torch.cos(torch.arange(p.numel()) * (0.1 + step + i))
            optimizer.step()
            assert all((p.grad is None) == release for p in params)
        results.append(([p.detach().clone() for p in params], optimizer.state_dict()))
    (kept, kept_state), (dropped, dropped_state) = results
    assert all(torch.equal(a, b) for a, b in zip(kept, dropped, strict=True))
    for a, b in zip(kept_state["state"].values(), dropped_state["state"].values(), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


def tiny_config(**extra) -> TrainerConfig:
    return TrainerConfig(run="r", agent="a", model_dir=str(ensure_tiny_model()), **extra)


def test_a_trainer_holds_3_bytes_a_parameter_resumes_it_and_refuses_the_other_kind():
    from updatelib import batch_of

    fp8 = LocalUpdater(tiny_config(optimizer_state="fp8", lr=1e-3))
    fp32 = LocalUpdater(tiny_config(lr=1e-3))
    for updater in (fp8, fp32):
        updater.step(batch_of(5), seed=1)
    params = sum(p.numel() for p in fp8.model.parameters())
    small, full = memory_of(fp8.model, fp8.optimizer), memory_of(fp32.model, fp32.optimizer)
    assert full["optimizer"] >= 8 * params
    tensors = sum(1 for p in fp8.model.parameters())  # each padded to a block, + its step
    assert small["optimizer"] <= 3 * params + tensors * (3 * BLOCK + 8) + 4 * params / BLOCK

    # saved as a checkpoint keeps it (torch.save, read back with weights_only) and resumed
    model_state, optimizer_state = fp8.state()
    import io

    buffer = io.BytesIO()
    torch.save(optimizer_state, buffer)
    buffer.seek(0)
    saved = torch.load(buffer, weights_only=True)
    resumed = LocalUpdater(tiny_config(optimizer_state="fp8", lr=1e-3))
    resumed.load_state({k: v.clone() for k, v in model_state.items()}, saved)
    one, two = fp8.step(batch_of(5), seed=2), resumed.step(batch_of(5), seed=2)
    assert one.loss == two.loss
    for a, b in zip(fp8.model.parameters(), resumed.model.parameters(), strict=True):
        assert torch.equal(a, b)

    with pytest.raises(TrainerConfigError, match="--optimizer-state fp8"):
        fp32.load_state(*fp8.state())
    with pytest.raises(TrainerConfigError, match="--optimizer-state fp32"):
        fp8.load_state(*fp32.state())


@pytest.mark.parametrize("extra", [{"dtype": "float64"}, {"parallel": "fsdp", "ray_workers": 2}])
def test_fp8_moments_are_refused_where_they_do_not_apply(extra):
    with pytest.raises(TrainerConfigError, match="--optimizer-state fp8"):
        tiny_config(optimizer_state="fp8", **extra)
