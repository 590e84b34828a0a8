"""Task advantage normalisation (--task-adv-norm, trainer/grpo.py departure 14) against a
reference written from its definition: mean and std over the task's model tokens (each
trajectory's advantage repeated once per trained token) or over its trajectories."""

from __future__ import annotations

import numpy as np
import pytest

from agentarium.schemas import LLMCall, Trajectory
from agentarium.trainer.batch import Sample, build_rows, with_task_advantages
from agentarium.trainer.grpo import task_normalized
from agentarium.trainer.rows import grpo_advantages

EPS = 1e-6


def reference(adv, tasks, groups, tokens, mode):
    """numpy, from the definition: flat groups (all advantages 0) stay 0 and are not counted;
    each task's remaining advantages are standardised over its tokens or trajectories."""
    adv, tasks, groups = np.asarray(adv, np.float64), np.asarray(tasks), np.asarray(groups)
    out = np.zeros_like(adv)
    flat = {g for g in set(groups.tolist()) if np.all(adv[groups == g] == 0.0)}
    for task in set(tasks.tolist()):
        idx = [i for i in range(len(adv)) if tasks[i] == task and groups[i] not in flat]
        if mode == "token":
            values = np.concatenate([np.full(tokens[i], adv[i]) for i in idx] + [np.zeros(0)])
        else:
            values = adv[idx]
        if values.size == 0 or values.std() == 0.0:
            continue
        for i in idx:
            out[i] = (adv[i] - values.mean()) / (values.std() + EPS)
    return out


def random_step(rng: np.random.Generator):
    """One step's trajectories: 3 tasks on different reward scales, groups of 2-6, some flat."""
    adv, tasks, groups, tokens = [], [], [], []
    for g in range(int(rng.integers(4, 12))):
        task = ["math", "code", "chat"][int(rng.integers(0, 3))]
        size = int(rng.integers(2, 7))
        scale = {"math": 1.0, "code": 10.0, "chat": 0.1}[task]
        if rng.random() < 0.25:
            rewards = [scale] * size  # flat: advantage 0 for every member
        else:
            rewards = (rng.normal(size=size) * scale).tolist()
        std_norm = bool(rng.random() < 0.5)
        adv += grpo_advantages(rewards, std_norm=std_norm, eps=EPS)
        tasks += [task] * size
        groups += [f"{task}/g{g}"] * size
        tokens += rng.integers(0, 20, size=size).tolist()
    return adv, tasks, groups, tokens


@pytest.mark.parametrize("mode", ["token", "trajectory"])
def test_matches_the_reference_on_random_steps(mode):
    """Deterministic: the steps come from ``np.random.default_rng(7)`` (PCG64, the same on
    every CPU); both sides are float64, so a failure is a disagreement, never a draw."""
    rng = np.random.default_rng(7)
    for _ in range(200):
        adv, tasks, groups, tokens = random_step(rng)
        weights = tokens if mode == "token" else [1] * len(adv)
        got = task_normalized(adv, tasks, groups, weights, eps=EPS)
        np.testing.assert_allclose(got, reference(adv, tasks, groups, tokens, mode), atol=1e-9)


def test_each_task_is_standardised_over_its_tokens_and_flat_groups_stay_zero():
    adv = [1.0, -1.0, 0.0, 0.0, 30.0, -10.0, -20.0]
    tasks = ["a", "a", "a", "a", "b", "b", "b"]
    groups = ["g1", "g1", "g2", "g2", "g3", "g3", "g3"]
    tokens = [3, 1, 5, 5, 2, 2, 4]
    out = np.array(task_normalized(adv, tasks, groups, tokens, eps=0.0))
    assert out[2] == out[3] == 0.0  # g2 is flat: untouched, and not in a's statistics
    for task, idx in (("a", [0, 1]), ("b", [4, 5, 6])):
        w = np.array(tokens)[idx]
        assert np.average(out[idx], weights=w) == pytest.approx(0.0, abs=1e-12), task
        assert np.sqrt(np.average(out[idx] ** 2, weights=w)) == pytest.approx(1.0), task
    # a task whose advantages are all equal, or that trains no token, gets zeros (no 0/0)
    assert task_normalized([0.5, 0.5], ["a", "a"], ["g", "h"], [1, 1], eps=0.0) == [0.0, 0.0]
    assert task_normalized([1.0, -1.0], ["a", "a"], ["g", "g"], [0, 0], eps=0.0) == [0.0, 0.0]


def _traj(job: str, agent: str, group: str, reward: float, calls: int) -> Trajectory:
    chat = [
        LLMCall(
            prompt_ids=[1, 2, 3 + c],  # the prompts do not chain: one row per call
            response_ids=[4] * (c + 2),
            response_logprobs=[-0.5] * (c + 2),
            finish_reason="stop",
        )
        for c in range(calls)
    ]
    return Trajectory(
        job_id=job,
        agent=agent,
        task_id=group,
        group_id=group,
        group_size=2,
        run="r",
        status="ok",
        reward=reward,
        calls=chat,
    )


def test_rows_get_their_trajectorys_task_normalised_advantage_weighted_by_trained_tokens():
    trajs = [
        _traj("a1", "a", "ga", 1.0, 1),
        _traj("a2", "a", "ga", 0.0, 3),  # three rows (per-call fallback): 2 + 3 + 4 tokens
        _traj("b1", "b", "gb", 5.0, 1),
        _traj("b2", "b", "gb", 0.0, 2),
    ]
    samples = []
    for group in (trajs[:2], trajs[2:]):
        advs = grpo_advantages([t.reward for t in group], eps=EPS)
        samples += [Sample(t, a) for t, a in zip(group, advs, strict=True)]
    rows, _ = build_rows(samples)
    tokens = {t.job_id: 0 for t in trajs}
    for row in rows:
        tokens[row.job_id] += sum(row.loss_mask)
    assert tokens == {"a1": 2, "a2": 9, "b1": 2, "b2": 5}
    expected = reference(
        [s.advantage for s in samples],
        [t.agent for t in trajs],
        [t.group_id for t in trajs],
        [tokens[t.job_id] for t in trajs],
        "token",
    )
    by_job = dict(zip([t.job_id for t in trajs], expected, strict=True))
    normed = with_task_advantages(rows, samples, mode="token", eps=EPS)
    assert [r.job_id for r in normed] == [r.job_id for r in rows]
    assert [r.advantage for r in normed] == pytest.approx([by_job[r.job_id] for r in rows])
    assert [r.input_ids for r in normed] == [r.input_ids for r in rows]
