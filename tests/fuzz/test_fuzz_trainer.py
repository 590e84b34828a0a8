"""The fuzzed trajectory corpus against a real trainer (tiny model) on a real nats-server.

Each of a few hundred groups holds three good members and one poisoned trajectory (published
last): undecodable ones (token and logprob lengths that differ, packed arrays cut short,
unknown statuses, NaN rewards on status ok, wrong types, garbage), unreadable weight versions,
data a step cannot use (NaN log-probs, token ids outside the vocabulary, non-finite sampling),
unreproducible sampling, failed members and empty responses. The trainer must run every step
with a finite loss, train every good member and no poisoned one, and say why for each.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter

import corpus
import msgpack
import pytest
import structlog.testing
import torch
from corpus import Poison, draw

from agentarium.schemas import LLMCall, Trajectory, decode, encode
from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.loop import Trainer
from agentarium.trainer.rows import refusal

torch.set_num_threads(1)
RUN, AGENT = "fuzztrain", "toy"
PER_KIND = 20  # poisoned trajectories per kind (15 kinds)
GROUPS_PER_STEP = 30  # x ~3 trajectories: under the SDK's 128 links per span


def good_members(g: int, size: int) -> list[Trajectory]:
    return [
        Trajectory(
            job_id=f"g{g}-v{i}",
            agent=AGENT,
            task_id=f"t{g}",
            group_id=f"grp{g}",
            group_size=size,
            run=RUN,
            status="ok",
            reward=float(i) / 2,  # 0, 0.5, 1: never a flat group
            # a train step's span links each trajectory it trained: how the test sees them
            trace_id=f"{g + 1:016x}{i + 1:016x}",
            span_id=f"{g + 1:08x}{i + 1:08x}",
            calls=[
                LLMCall(
                    prompt_ids=[257, 48 + g % 10, 258],
                    response_ids=[48 + i, 258],
                    response_logprobs=[-5.5, -5.6],
                    finish_reason="stop",
                )
            ],
        )
        for i in range(3)
    ]


def poisoned_payload(poison: Poison, g: int) -> bytes:
    if poison.wire is None:
        return poison.payload
    wire = dict(poison.wire)
    for key, value in {
        "job_id": f"g{g}-p",
        "agent": AGENT,
        "task_id": f"t{g}",
        "group_id": f"grp{g}",
        "group_size": 4,
        "run": RUN,
        "trace_id": f"{g + 1:016x}{99:016x}",
        "span_id": f"{g + 1:08x}{99:08x}",
    }.items():
        wire.setdefault(key, value)  # the poison may hold a bad one on purpose
    return msgpack.packb(wire, use_bin_type=True)


@pytest.mark.timeout(240)
async def test_fuzzed_trajectories_are_refused_with_a_reason_and_never_crash_the_trainer(
    js, topology, tmp_path, span_exporter
):
    started = time.monotonic()
    poisons: list[Poison] = []
    for kind in corpus.TRAJECTORY_KINDS:
        poisons += draw(corpus.poisons(kind), PER_KIND)
    groups = len(poisons) - len(poisons) % GROUPS_PER_STEP
    poisons = poisons[:groups]
    generated_s = time.monotonic() - started
    messages = []
    for g, poison in enumerate(poisons):
        # A poison the buffer skips (undecodable) never joins its group, which is its three
        # good members; one of weights not the run's (bad_version) joins it as a member never
        # trained: both are published first, before the group closes. Any other completes a
        # group of four (published last: the group's size comes from the good ones). No group
        # waits for a timeout.
        skipped = poison.fate in ("undecodable", "bad_version")
        good = [(t.job_id, encode(t)) for t in good_members(g, 3 if skipped else 4)]
        bad = [(f"g{g}-p", poisoned_payload(poison, g))]
        messages += bad + good if skipped else good + bad
    for start in range(0, len(messages), 256):  # in order, 256 acks awaited at a time
        acks = [
            await js.publish_async(topology.trajectory_subject(RUN, AGENT, job_id), payload)
            for job_id, payload in messages[start : start + 256]
        ]
        await asyncio.gather(*acks)

    config = TrainerConfig(
        run=RUN,
        agent=AGENT,
        model_dir=str(ensure_tiny_model()),
        group_size=4,
        groups_per_step=GROUPS_PER_STEP,
        lr=1e-3,
        group_timeout_s=600.0,  # every group completes: none is released by a timeout
        metrics_path=str(tmp_path / "metrics.csv"),
    )
    # no publisher: the version stays 0, so no group goes stale while the corpus is trained
    trainer = Trainer(config, js, topology=topology)
    with structlog.testing.capture_logs() as logs:
        summary = await trainer.run(max_steps=groups // GROUPS_PER_STEP)
    assert summary.steps == groups // GROUPS_PER_STEP

    steps = [s for s in span_exporter.get_finished_spans() if s.name == "train step"]
    trained = [link.attributes["agentarium.job_id"] for s in steps for link in s.links]
    assert len(trained) == len(set(trained))  # each trajectory trained once
    assert all(math.isfinite(s.attributes["agentarium.loss"]) for s in steps)
    model = trainer._updater.publishable_model()
    assert all(torch.isfinite(p).all() for p in model.parameters())

    undecodable = {
        e["subject"].rsplit(".", 1)[1]: e["error"]
        for e in logs
        if e["event"] == "undecodable trajectory acked and skipped"
    }
    wrong = []
    for g, poison in enumerate(poisons):
        job_id = f"g{g}-p"
        good = {f"g{g}-v{i}" for i in range(3)}
        if not good <= set(trained):
            wrong.append(f"{poison.category}: good members of group {g} not trained")
        is_trained = job_id in trained
        if poison.fate == "harmless":
            ok = is_trained
        elif poison.fate == "undecodable":
            error = undecodable.get(job_id, "")
            ok = not is_trained and any(word in error for word in poison.reason)
        elif poison.fate == "bad_version":
            # a version string no trainer of the run wrote is not the run's weights: never
            # trained, out of its group's statistics, counted (foreign_weights, below)
            ok = not is_trained
        elif poison.fate == "refused":
            why = refusal(decode(Trajectory, poisoned_payload(poison, g)), corpus.TINY_VOCAB)
            ok = not is_trained and any(word in (why or "") for word in poison.reason)
        else:
            ok = not is_trained
        if not ok:
            wrong.append(f"{poison.category} {job_id} {poison.reason} {poison.wire}")
    assert not wrong, (
        f"{len(wrong)} of {len(poisons)} wrong ({summary.counters}, {len(trained)} trained, {len(steps)} steps):\n"
        + "\n".join(wrong[:20])
    )

    fates = Counter(p.fate for p in poisons)
    counters = summary.counters
    assert counters["invalid"] == fates["undecodable"]
    assert counters["dropped_stale"] == 0
    assert counters["refused"] == fates["refused"]
    assert counters["foreign_weights"] == fates["bad_version"]
    assert counters["failed_members"] == fates["failed"]
    assert counters["groups_complete"] == groups and counters["late"] == 0
    print(
        f"\nfuzzed trainer corpus: {len(poisons)} poisoned trajectories among "
        f"{3 * len(poisons)} good ones, {summary.steps} steps; generated in {generated_s:.1f}s, "
        f"total {time.monotonic() - started:.1f}s"
    )
    for category, n in sorted(Counter(p.category for p in poisons).items()):
        print(f"  {n:5d}  {category}")
