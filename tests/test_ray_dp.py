"""``--ray-workers 2`` on CPU (Ray actors, torch.distributed over gloo) computes the same update
as one worker on the same batch."""

from __future__ import annotations

import pytest
import torch
from trainlib import one_call_group, publish

from agentarium.schemas import LLMCall, Trajectory
from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.batch import Sample, build_rows, collate
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.step import LocalUpdater

ray = pytest.importorskip("ray")
torch.set_num_threads(1)


def batch_of(rows: int):
    samples = []
    for i in range(rows):
        n = 1 + i % 3  # uneven lengths, so the shards pad differently
        call = LLMCall(
            prompt_ids=[257, 60 + i, 61, 62 + i % 2],
            response_ids=[48 + i % 10, 49, 258][-n:],
            response_logprobs=[-5.0, -4.0, -6.0][:n],
            finish_reason="stop",
            temperature=1.0 if i % 2 else 0.8,
        )
        traj = Trajectory(
            job_id=f"j{i}",
            agent="a",
            task_id="t",
            group_id="g",
            status="ok",
            reward=float(i % 2),
            calls=[call],
        )
        samples.append(Sample(traj, advantage=(i % 4 - 1.5) / 1.1, tis=i == 3))
    return collate(build_rows(samples)[0], pad_id=256)


@pytest.fixture(scope="module")
def ray_local():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


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
    try:
        for step in (1, 2):  # the second step also checks the optimizer states stayed equal
            one = single.step(batch, seed=step)
            two = dp.step(batch, seed=step)
            assert two.loss == pytest.approx(one.loss, rel=1e-5, abs=1e-7)
            assert two.model_tokens == one.model_tokens and two.rows == one.rows
            assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
        want, _ = single.state()
        got, _ = dp.state()
        moved = 0.0
        initial = LocalUpdater(config).model.state_dict()
        for name, tensor in want.items():
            torch.testing.assert_close(got[name], tensor, atol=2e-6, rtol=1e-5, msg=name)
            moved = max(moved, float((tensor - initial[name]).abs().max()))
        assert moved > 1e-4  # the weights did change: the comparison means something
        mirror = dp.publishable_model()
        torch.testing.assert_close(
            mirror.state_dict()["lm_head.weight"], want["lm_head.weight"], atol=2e-6, rtol=1e-5
        )
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
