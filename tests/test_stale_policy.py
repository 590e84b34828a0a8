"""--stale-policy drop|tis|mask: what becomes of a member too stale to train on, and of the
too-stale tokens of a member whose call crossed a weight update (``LLMCall.weight_spans``).

Whatever the policy, a too-stale member's reward stays in its group's advantage statistics (the
baseline); ``drop`` trains none of its tokens, ``mask`` none of its too-stale ones (its fresher
tokens train: prime-rl's token-level masking), ``tis`` weights its too-stale ones."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import torch
from trainlib import one_call_group, publish, served, tiny_config

from agentarium.schemas import LLMCall, Trajectory
from agentarium.trainer.batch import build_rows
from agentarium.trainer.groups import BUFFERED, GroupBuffer, Selection
from agentarium.trainer.loop import Trainer
from agentarium.trainer.metrics import read_metrics
from agentarium.trainer.rows import grpo_advantages

torch.set_num_threads(1)
RUN, AGENT = "stale", "toy"
NOW = 3  # the trainer's version; with max staleness 1, versions 2 and 3 are fresh
REWARDS = {"fresh0": 1.0, "fresh1": 0.0, "split": 1.0, "old": 0.0}


def call(spans: list[tuple[int, int]], n: int = 4) -> LLMCall:
    """A policy call of ``n`` response tokens; ``spans``: (the run's version, first token)."""
    identities = [(served(RUN, v), start) for v, start in spans]
    return LLMCall(
        prompt_ids=[1, 2, 3],
        response_ids=[10 + i for i in range(n)],
        response_logprobs=[-0.5] * n,
        finish_reason="stop",
        weight_version=identities[-1][0],
        weight_spans=identities if len(identities) > 1 else [],
    )


def member(job: str, spans: list[tuple[int, int]]) -> Trajectory:
    return Trajectory(
        job_id=job,
        agent=AGENT,
        task_id="t",
        group_id="g",
        group_size=len(REWARDS),
        run=RUN,
        status="ok",
        reward=REWARDS[job],
        calls=[call(spans)],
    )


def selected(policy: str):
    """The group of four: two fresh members, ``split`` (tokens 0-1 by version 1, too stale;
    2-3 by version 3) and ``old`` (every token by version 0), selected at version 3."""
    buffer = GroupBuffer(group_timeout_s=600, run=RUN)
    for job, spans in (
        ("fresh0", [(3, 0)]),
        ("fresh1", [(2, 0)]),
        ("split", [(1, 0), (3, 2)]),
        ("old", [(0, 0)]),
    ):
        assert buffer.add(member(job, spans), None, now=0.0) == BUFFERED
    (group,), dropped = buffer.select(
        1, Selection(version=NOW, max_staleness=1, stale_policy=policy)
    )
    assert not dropped
    return group, buffer.counters


def test_every_policy_keeps_the_stale_rewards_in_the_baseline():
    expected = dict(zip(REWARDS, grpo_advantages(list(REWARDS.values())), strict=True))
    for policy in ("drop", "tis", "mask"):
        group, _ = selected(policy)
        advantages = {s.trajectory.job_id: s.advantage for s in group.samples}
        assert advantages == {job: expected[job] for job in advantages}, policy
        # each member by its oldest token, each token by its own version
        assert sorted(group.staleness) == [0, 1, 2, 3]
        assert group.token_staleness == {0: 4 + 2, 1: 4, 2: 2, 3: 4}


def test_drop_trains_no_token_of_a_member_with_a_stale_one():
    group, c = selected("drop")
    assert sorted(s.trajectory.job_id for s in group.samples) == ["fresh0", "fresh1"]
    assert (c.dropped_stale, c.stale_masked, c.tis_weighted) == (2, 0, 0)
    rows, stats = build_rows(group.samples)
    assert stats.model_tokens == 8 and stats.masked_tokens == stats.tis_tokens == 0


def test_mask_trains_the_fresh_tokens_and_none_of_the_stale_ones():
    group, c = selected("mask")
    # "old" has no fresh token: its reward is in the baseline, it becomes no sample
    assert sorted(s.trajectory.job_id for s in group.samples) == ["fresh0", "fresh1", "split"]
    assert (c.dropped_stale, c.stale_masked, c.tis_weighted) == (0, 2, 0)
    assert sorted(group.other_job_ids) == ["old"]
    rows, stats = build_rows(group.samples)
    by_job = {row.job_id: row for row in rows}
    prompt = [0, 0, 0]
    assert by_job["split"].loss_mask == prompt + [0, 0, 1, 1]  # version 1's two tokens masked
    assert by_job["fresh0"].loss_mask == prompt + [1, 1, 1, 1]
    assert not any(any(row.tis) for row in rows)
    assert (stats.model_tokens, stats.masked_tokens) == (4 + 4 + 2, 2)


def test_tis_weights_the_stale_tokens_only():
    group, c = selected("tis")
    assert sorted(s.trajectory.job_id for s in group.samples) == [
        "fresh0",
        "fresh1",
        "old",
        "split",
    ]
    assert (c.dropped_stale, c.stale_masked, c.tis_weighted) == (0, 0, 2)
    rows, stats = build_rows(group.samples)
    by_job = {row.job_id: row for row in rows}
    prompt = [0, 0, 0]
    assert by_job["split"].tis == prompt + [1, 1, 0, 0]
    assert by_job["old"].tis == prompt + [1, 1, 1, 1]
    assert by_job["fresh1"].tis == prompt + [0, 0, 0, 0]
    assert all(row.loss_mask[3:] == [1, 1, 1, 1] for row in rows)  # every token trains
    assert (stats.model_tokens, stats.tis_tokens) == (16, 6)


class LatestIs:
    """A publisher whose predecessor published up to ``version``; records nothing."""

    def __init__(self, version: int) -> None:
        self.version = version

    async def publish(self, model, version: int, step: int) -> None:
        pass

    async def latest_version(self) -> int | None:
        return self.version


@pytest.mark.parametrize("policy", ["drop", "mask"])
async def test_a_step_keeps_the_group_of_a_stale_member(js, topology, tmp_path, policy):
    # two groups of four sampled by version 3; in the second, member 0 (reward 1) was sampled by
    # version 0: at version 3 with max staleness 1 it is too stale
    groups = []
    for g in range(2):
        group = one_call_group(
            g,
            run=RUN,
            agent=AGENT,
            job_id=lambda g, i: f"j{g}-{i}",
            group_id=f"g{g}",
            reward=lambda g, i: float(i == 0),
            version=served(RUN, NOW),
        )
        groups.append(group)
    stale = groups[1][0]
    old_call = dataclasses.replace(stale.calls[0], weight_version="default")
    groups[1][0] = dataclasses.replace(stale, calls=[old_call])
    for group in groups:
        await publish(js, topology, group)
    cfg = tiny_config(
        run=RUN,
        agent=AGENT,
        max_staleness=1,
        stale_policy=policy,
        metrics_path=str(tmp_path / "metrics.csv"),
    )
    trainer = Trainer(cfg, js, topology=topology, publisher=LatestIs(NOW))
    async with asyncio.timeout(60):
        summary = await trainer.run(max_steps=1)
    (row,) = read_metrics(tmp_path / "metrics.csv")
    # both groups train; the stale member's 2 tokens are not in the loss (7 members x 2)
    assert (summary.trained, row["groups_used"], row["model_tokens"]) == (7, "2", "14")
    assert row["stale_policy"] == policy
    counted = {"drop": ("1", "0"), "mask": ("0", "1")}[policy]
    assert (row["dropped_stale"], row["stale_masked"]) == counted
    assert row["staleness_max"] == "3" and summary.counters["dropped_stale_groups"] == 0


def test_importance_weights_are_per_token():
    """A row with its first tokens too stale: their loss is the TIS loss (ratio against the
    current policy, weight min(pi / pi_rollout, 2)), the others' the plain clipped one. Under
    token-mean the row's loss is the sum of the two parts, each computed alone with the other's
    tokens out of the mask."""
    from agentarium.tiny import ensure_tiny_model
    from agentarium.trainer.batch import Row, collate
    from agentarium.trainer.step import StepSettings, Totals, forward_backward, load_model

    model = load_model(ensure_tiny_model(), "cpu")
    prompt, response = [257, 40, 41, 42], [48, 49, 50, 51, 52, 258]
    stale = [1, 1, 1, 0, 0, 0]  # the call crossed an update after its third token
    fresh = [1 - s for s in stale]

    def loss(mask: list[int], tis: list[int]) -> float:
        row = Row(
            input_ids=prompt + response,
            loss_mask=[0] * len(prompt) + mask,
            # far below the tiny model's (about -5.6, 1/263): every ratio is past both the
            # clip (1.2) and the TIS cap (2), so TIS and plain tokens lose differently
            old_logprobs=[0.0] * len(prompt) + [-9.0] * len(response),
            temperature=[1.0] * (len(prompt) + len(response)),
            advantage=0.8,
            tis=[0] * len(prompt) + tis,
            job_id="j",
        )
        batch = collate([row], pad_id=256)
        model.zero_grad(set_to_none=True)
        value, _ = forward_backward(model, None, batch, StepSettings(), Totals.of(batch), "cpu")
        return value

    whole = loss([1] * 6, stale)
    parts = loss(stale, stale) * sum(stale) + loss(fresh, [0] * 6) * sum(fresh)
    # fp32: the same per-token terms summed in another order, 6 of them: a few 2^-24 apart
    assert whole == pytest.approx(parts / 6, rel=6 * 2**-24 * 4)
    # A = 0.8, ratios past every cap: a TIS token loses -A * 2, a plain one -A * 1.2 (fp32: six
    # rounded terms summed and divided, well within 8 ulp, 2^-20)
    assert loss([1] * 6, [1] * 6) == pytest.approx(-0.8 * 2.0, rel=2**-20)
    assert loss([1] * 6, [0] * 6) == pytest.approx(-0.8 * 1.2, rel=2**-20)
    assert whole == pytest.approx(-0.8 * (3 * 2.0 + 3 * 1.2) / 6, rel=2**-20)
