"""Dynamic sampling: flat groups are dropped and replaced by groups the trainer asks the run's
producers for, so every step trains its configured number of groups and says how many it drew;
responses cut at max_new_tokens are filtered or given a set reward, counted.

The whole path is real: nats-server, a ``producers.GroupRefill`` answering the trainer's
``GroupDemand`` requests, a rollout worker running ``agentlib.scored`` against an SGLang fake
(the one faked boundary), and the trainer on the tiny model.

No draw decides a count here: which groups are flat is set by the task (``agentlib.scored``:
a flat task scores 1.0 for every sample, any other alternates 0 and 1), so the draws, drops
and groups trained are the same on every run; the sampled text is never scored.
"""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch
from agentlib import scored
from worker_env import worker_for

from agentarium.producers import GroupRefill, TaskProducer
from agentarium.schemas import LLMCall, Trajectory
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.groups import GroupBuffer, Selection
from agentarium.trainer.loop import Trainer
from agentarium.trainer.metrics import read_metrics

torch.set_num_threads(1)
RUN, AGENT, B, G = "dyn", "scored", 2, 4


def config(tiny_dir, tmp_path, **extra) -> TrainerConfig:
    return TrainerConfig(
        run=RUN,
        agent=AGENT,
        model_dir=str(tiny_dir),
        group_size=G,
        groups_per_step=B,
        lr=1e-3,
        dynamic_sampling=True,
        metrics_path=str(tmp_path / "metrics.csv"),
        **extra,
    )


def source(kinds):
    """Refill tasks: ``kinds`` says which are flat, then informative ones forever."""
    counter = itertools.count()

    def tasks(n: int) -> list[dict]:
        out = []
        for _ in range(n):
            i = next(counter)
            kind = kinds[i] if i < len(kinds) else "normal"
            out.append({"task_id": f"refill-{i}", "prompt": f"p{i}", "flat": kind == "flat"})
        return out

    return tasks


async def train(js, topology, fake, tiny_dir, tmp_path, first, refill_kinds, steps, **extra):
    scored.seen.clear()
    producer = TaskProducer(js, topology)
    trainer = Trainer(config(tiny_dir, tmp_path, **extra), js, topology=topology)
    refill = GroupRefill(producer, run=RUN, agent=AGENT, tasks=source(refill_kinds), group_size=G)
    async with refill, worker_for(js, AGENT, scored, [fake.url], burst=False) as worker:
        rollouts = asyncio.create_task(worker.run())
        try:
            await producer.submit(AGENT, first, run=RUN, group_size=G)
            summary = await asyncio.wait_for(trainer.run(max_steps=steps), timeout=90)
        finally:
            worker.stop()
            await rollouts
    return summary, refill, read_metrics(tmp_path / "metrics.csv")


async def test_flat_groups_are_replaced_and_every_step_keeps_its_groups(
    js, topology, fake, tiny_dir, tmp_path
):
    first = [
        {"task_id": "flat-0", "prompt": "a", "flat": True},
        {"task_id": "flat-1", "prompt": "b", "flat": True},
        {"task_id": "normal-0", "prompt": "c"},
        # every reply cut at 2 tokens: filtered, so the group has no trainable member left
        {"task_id": "long-0", "prompt": "d", "max_new_tokens": 2},
    ]
    summary, refill, rows = await train(
        js, topology, fake, tiny_dir, tmp_path, first, ["flat"], steps=2, overlong="filter"
    )
    assert summary.steps == 2
    assert [int(r["groups_used"]) for r in rows] == [B, B]  # full batches, every step
    drawn = [int(r["drawn"]) for r in rows]
    assert [int(r[f"drawn/{AGENT}"]) for r in rows] == drawn
    c = summary.counters
    # every group the selection dropped was replaced, and the step says how many it drew
    assert sum(drawn) == refill.drawn == c["dropped_flat"] + c["dropped_small"]
    assert c["dropped_flat"] >= 3 and c["dropped_small"] == 1  # 2 + the refilled flat one
    assert c["overlong_filtered"] == G and int(rows[-1]["overlong"]) == G
    assert refill.answered >= 2


async def test_a_step_trains_what_it_holds_once_its_draws_are_spent(
    js, topology, fake, tiny_dir, tmp_path
):
    first = [
        {"task_id": "normal-0", "prompt": "c"},
        {"task_id": "flat-0", "prompt": "a", "flat": True},
    ]
    summary, refill, rows = await train(
        js, topology, fake, tiny_dir, tmp_path, first, ["flat"] * 10, steps=1, draw_limit=1
    )
    # the bound is 1 x B = 2 replacements; both were flat, so the step trained the one it had
    assert [int(r["groups_used"]) for r in rows] == [1]
    assert int(rows[0]["drawn"]) == refill.drawn == B
    assert summary.counters["dropped_flat"] == 3


def test_dynamic_sampling_turns_flat_filtering_on(tiny_dir, tmp_path):
    assert config(tiny_dir, tmp_path).filter_flat_groups
    assert config(tiny_dir, tmp_path, draw_limit=2).draw_limit == 2


@pytest.mark.parametrize("policy, trained, reward", [("filter", 3, None), ("reward", 4, -1.0)])
def test_overlong_responses_are_filtered_or_given_the_set_reward(policy, trained, reward):
    buffer = GroupBuffer(group_timeout_s=60, overlong=policy, overlong_reward=-1.0)
    for i in range(4):
        call = LLMCall(
            prompt_ids=[1, 2],
            response_ids=[3, 4],
            response_logprobs=[-1.0, -1.0],
            finish_reason="length" if i == 0 else "stop",
        )
        traj = Trajectory(
            job_id=f"j{i}",
            agent="a",
            task_id="t",
            group_id="g",
            group_size=4,
            status="ok",
            reward=float(i % 2),
            calls=[call],
        )
        buffer.add(traj, object(), now=0.0)
    (group,), _ = buffer.select(1, Selection(version=0, max_staleness=4))
    assert len(group.samples) == trained
    counted = buffer.counters.overlong_filtered + buffer.counters.overlong_rewarded
    assert counted == 1
    if reward is not None:
        assert group.members["j0"].trajectory.reward == reward


async def test_draws_stop_at_the_bound_unless_the_step_holds_nothing(nc, topology):
    """No producer serves the run: each request is counted as unanswered; past the bound a
    step holding groups is done drawing, one holding none goes on asking."""
    from agentarium.trainer.draws import Draws

    draws = Draws(nc, topology, RUN, limit=2, timeout_s=1.0)
    draws.begin(1)
    assert await draws.replace(AGENT, 3, holding=1) == 0  # asks 2 of 3: the bound
    assert (draws.asked, draws.exhausted, draws.unanswered) == (2, True, 1)
    await draws.replace(AGENT, 1, holding=0)  # nothing to train: asked all the same
    assert (draws.asked, draws.unanswered) == (3, 2)
    draws.begin(2)
    assert (draws.asked, draws.exhausted, draws.drawn) == (0, False, {})
