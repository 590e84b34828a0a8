"""``--ray-workers 2`` on CPU (Ray actors, torch.distributed over gloo) computes the same update
as one worker on the same batch."""

from __future__ import annotations

import copy

import pytest
import torch
from trainlib import one_call_group, publish
from updatelib import batch_of

from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.step import LocalUpdater

ray = pytest.importorskip("ray")
torch.set_num_threads(1)

# Tolerances of test_two_ray_workers_match_one_worker. Two ranks reduce each gradient element in
# another order than one process does, and torch's CPU kernels (AVX2 or AVX-512) pick their own
# block orders, so every gradient element carries rounding noise. fp32's unit roundoff is
# u = 2^-24 ~ 6.0e-8. Noise model: a gradient element of a tensor whose largest gradient is G
# differs by at most 64 u G (the batch has 13 model tokens and a 2-layer model; each element
# is a sum of 13 token terms through a few roundings of backward: (13 + a few) u G < 64 u G).
# Measured with both kernels (ATEN_CPU_CAPABILITY default and avx2) on an AVX-512 machine: the
# first moments differ by <= 6 u max|m|, the loss by <= 11 u relative, the gradient norm by <= 4 u.
# AdamW's moments m, v are sums of gradients with weights summing to 1 - beta^t, so m_hat and
# sqrt(v_hat) (a weighted 2-norm) each differ by at most delta = 64 u G: checked directly.
# The weights: u_t = m_hat / (sqrt(v_hat) + eps) differs by at most
# (delta + |m_hat| delta / sqrt(v_hat)) / (sqrt(v_hat) + eps)
#   <= 2.0014 delta / (sqrt(v_hat) + eps)
# (Cauchy-Schwarz at t <= 2 with betas (0.9, 0.999): |m_hat| <= 1.0014 sqrt(v_hat)), and never by
# more than 2 x 1.0014 (each |u_t| <= 1.0014); a weight then differs by lr times the sum over
# steps, plus two fp32 roundings of the weight itself (2 ULP relative, ULP = 2^-23).
U = 2.0**-24
ULP = 2.0**-23
NOISE = 64 * U
BETA2 = 0.999


def scale(adam: list[dict], i: int, t: int) -> float:
    """G of step t + 1 for parameter i: the largest |g_t| from the one-process AdamW state
    (v_1 = (1 - b2) g_1^2 and v_2 = (1 - b2) (b2 g_1^2 + g_2^2): |g_t| <= sqrt(v_t / (1 - b2)))."""
    return float((adam[t][i]["exp_avg_sq"] / (1 - BETA2)).sqrt().max())


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.mark.kernels  # gradients compared: run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)
@pytest.mark.long(75)
@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_two_ray_workers_match_one_worker(ray_local, loss_agg):
    from agentarium.trainer.ray_dp import RayDataParallel

    config = TrainerConfig(
        run="r",
        agent="a",
        model_dir=str(ensure_tiny_model()),
        lr=1e-3,
        loss_agg=loss_agg,
        kl_coef=0.05,
        grad_clip=0.5,
    )
    batch = batch_of(7)
    single = LocalUpdater(config)
    dp = RayDataParallel(config, 2)
    initial = {k: v.clone() for k, v in single.model.state_dict().items()}
    assert config.adam_betas == (0.9, BETA2) and config.weight_decay == 0
    try:
        theirs_adam = []
        adam = []  # the one-process run's AdamW state after each step: the tolerances' inputs
        for step in (1, 2):  # the second step also checks the optimizer states stayed equal
            one = single.step(batch, seed=step)
            two = dp.step(batch, seed=step)
            # NOISE (module docstring): rel 64 u; measured <= 11 u (loss), 4 u (norm)
            assert two.loss == pytest.approx(one.loss, rel=NOISE, abs=1e-7)
            assert two.model_tokens == one.model_tokens and two.rows == one.rows
            assert two.grad_norm == pytest.approx(one.grad_norm, rel=NOISE)
            adam.append(copy.deepcopy(single.state()[1]["state"]))  # a copy: AdamW steps in place
            theirs_adam.append(dp.state()[1]["state"])
        want, _ = single.state()
        got, _ = dp.state()
        names = [name for name, _ in single.model.named_parameters()]
        moved = 0.0
        for i, name in enumerate(names):
            # per-step bound: step 2's moments hold step 1's gradient too
            delta = [NOISE * max(scale(adam, i, s) for s in range(t + 1)) for t in range(2)]
            for t in range(2):
                # what data parallelism could break: the all-reduced gradient, seen through
                # AdamW's moments, sums of gradients (no division amplifies their noise)
                mine, theirs = adam[t][i], theirs_adam[t][i]
                bc1, bc2 = 1 - 0.9 ** (t + 1), 1 - BETA2 ** (t + 1)
                torch.testing.assert_close(
                    theirs["exp_avg"] / bc1,
                    mine["exp_avg"] / bc1,
                    atol=delta[t],
                    rtol=0,
                    msg=lambda m, name=name, t=t: f"{name}, step {t + 1}: {m}",
                )
                torch.testing.assert_close(
                    (theirs["exp_avg_sq"] / bc2).sqrt(),
                    (mine["exp_avg_sq"] / bc2).sqrt(),
                    atol=delta[t],
                    rtol=0,
                    msg=lambda m, name=name, t=t: f"{name}, step {t + 1}: {m}",
                )
            # the weights: each AdamW step divides the gradient by sqrt(v_hat), so an element
            # whose gradient is rounding noise alone (a key projection's bias: softmax ignores a
            # shift common to every key) moves by up to lr in either run: bound per element
            bound = 2 * ULP * want[name].abs() + 1e-12  # the weight's own two roundings
            for t, state in enumerate(adam):
                root = (state[i]["exp_avg_sq"] / (1 - BETA2 ** (t + 1))).sqrt()
                bound += config.lr * torch.clamp(2.0014 * delta[t] / (root + 1e-8), max=2.0028)
            diff = (got[name] - want[name]).abs()
            assert bool((diff <= bound).all()), (name, float((diff / bound).max()))
            moved = max(moved, float((want[name] - initial[name]).abs().max()))
        assert moved > 1e-4  # the weights did change: the comparison means something
        mirror = dp.publishable_model()
        assert torch.equal(mirror.state_dict()["lm_head.weight"], got["lm_head.weight"])
    finally:
        dp.close()


async def test_trainer_with_ray_workers_checkpoints_rank_zero_weights(
    ray_local, js, topology, tmp_path
):
    from agentarium.trainer.checkpoint import Checkpoints
    from agentarium.trainer.loop import Trainer

    for g in range(2):
        group = one_call_group(
            g,
            run="r",
            agent="a",
            job_id=lambda g, i: f"j{g}{i}",
            group_id=f"g{g}",
            reward=lambda g, i: float(i == g),
        )
        await publish(js, topology, group)
    config = TrainerConfig(
        run="r",
        agent="a",
        model_dir=str(ensure_tiny_model()),
        lr=1e-3,
        group_size=4,
        groups_per_step=2,
        ray_workers=2,
        checkpoint_dir=str(tmp_path / "ckpt"),
    )
    summary = await Trainer(config, js, topology=topology).run(max_steps=1)
    assert summary.steps == 1 and summary.trained == 8
    checkpoints = Checkpoints(tmp_path / "ckpt")
    saved = checkpoints.load(checkpoints.latest()).model_state
    initial = LocalUpdater(config).model.state_dict()
    assert not torch.equal(saved["lm_head.weight"], initial["lm_head.weight"])
