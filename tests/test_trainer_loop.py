"""The Trainer in-process on a real nats-server: publishing hook and versions, the train step
span's links, metrics CSV and plot, and settings refused at the edge."""

from __future__ import annotations

import argparse
import asyncio
import json

import pytest
import torch
from trainlib import one_call_group, publish, served, tiny_config

from agentarium.broker import read_tail
from agentarium.commands.trainer_cmd import add_trainer_arguments, config_from_args
from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.errors import TrainerConfigError
from agentarium.trainer.loop import Trainer, WeightPublisher
from agentarium.trainer.metrics import COLUMNS, plot_metrics, read_metrics

torch.set_num_threads(1)
RUN, AGENT = "loop", "toy"


class RecordingPublisher:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, float]] = []

    async def publish(self, model, version: int, step: int) -> None:
        self.calls.append((version, step, float(model.lm_head.weight.detach().sum())))

    async def latest_version(self) -> int | None:
        return None


async def publish_groups(js, topology, groups: int, *, version="default", prefix="j"):
    for g in range(groups):
        await publish(
            js,
            topology,
            one_call_group(
                g,
                run=RUN,
                agent=AGENT,
                job_id=lambda g, i: f"{prefix}{g}-{i}",
                group_id=f"{prefix}g{g}",
                reward=lambda g, i: float(i == g % 4),
                version=version,
                trace=True,
            ),
        )


def config(tmp_path, **overrides) -> TrainerConfig:
    return tiny_config(
        **{"run": RUN, "agent": AGENT, "metrics_path": str(tmp_path / "metrics.csv"), **overrides}
    )


async def test_publishes_versions_links_trajectories_and_writes_metrics(
    js, topology, tmp_path, span_exporter
):
    await publish_groups(js, topology, 4)
    publisher = RecordingPublisher()
    assert isinstance(publisher, WeightPublisher)
    trainer = Trainer(config(tmp_path, publish_every=1), js, topology=topology, publisher=publisher)
    summary = await trainer.run(max_steps=2)
    assert (summary.steps, summary.version, summary.trained) == (2, 2, 16)
    assert [(v, s) for v, s, _ in publisher.calls] == [(1, 1), (2, 2)]
    assert publisher.calls[0][2] != publisher.calls[1][2]  # the live, updated model

    steps = [s for s in span_exporter.get_finished_spans() if s.name == "train step"]
    assert len(steps) == 2
    linked = {f"{link.context.trace_id:032x}" for s in steps for link in s.links}
    assert linked == {f"{g + 1:016x}{i + 1:016x}" for g in range(4) for i in range(4)}
    assert all(link.attributes["agentarium.job_id"] for s in steps for link in s.links)

    rows = read_metrics(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [1, 2] and tuple(rows[0])[: len(COLUMNS)] == COLUMNS
    assert [int(r["version"]) for r in rows] == [0, 1]  # the version the step's data was judged by
    assert rows[0]["reward_mean_trained"] == "0.25" and rows[0]["staleness_hist"] == "0:8"
    assert float(rows[0]["tokens_per_s"]) > 0 and int(rows[0]["tokens"]) == 8 * 5
    info = await js.consumer_info(topology.trajectories_stream, f"trainer-{RUN}-{AGENT}")
    assert info.num_ack_pending == 0  # no checkpoint dir: acked after each step
    # the same rows, live on <p>.metrics.<run> for the dashboard
    live = (await read_tail(js, topology.metrics_stream, last=10)).messages
    assert [m.subject for m in live] == [topology.metrics_subject(RUN)] * 2
    published = [json.loads(m.data) for m in live]
    assert [(p["run"], p["agent"], p["step"]) for p in published] == [
        (RUN, AGENT, 1),
        (RUN, AGENT, 2),
    ]
    assert [str(p["reward_mean_trained"]) for p in published] == [
        r["reward_mean_trained"] for r in rows
    ]

    png = plot_metrics(tmp_path / "metrics.csv", tmp_path / "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    # IHDR width x height: matplotlib's 8 x 4.5 inch figure at 100 dpi
    assert (int.from_bytes(png[16:20]), int.from_bytes(png[20:24])) == (800, 450)


async def test_stale_trajectories_dropped_against_published_versions(js, topology, tmp_path):
    await publish_groups(js, topology, 2, version="default", prefix="old")
    await publish_groups(js, topology, 2, version=served(RUN, 3), prefix="new")
    publisher = RecordingPublisher()
    publisher.latest_version = _returns(3)  # a predecessor published up to version 3
    trainer = Trainer(
        config(tmp_path, max_staleness=1, checkpoint_dir=str(tmp_path / "c")),
        js,
        topology=topology,
        publisher=publisher,
        resume=True,
    )
    # resume without a checkpoint starts fresh; the version still comes from the publisher
    summary = await trainer.run(max_steps=1)
    assert summary.trained == 8 and summary.counters["dropped_stale"] == 8
    row = read_metrics(tmp_path / "metrics.csv")[0]
    assert (row["dropped_stale"], row["version"]) == ("8", "3")
    assert (row["stale_policy"], row["stale_masked"]) == ("drop", "0")  # the policy, named


async def test_other_weights_are_never_trained_and_the_csv_names_both_rewards(
    js, topology, tmp_path
):
    # Sampled by weights this run did not publish: another run's identity, or a server's own
    # version string. Not this run's policy: out of statistics, rewards and training, counted
    # (foreign_weights) and acked, so the trainer goes on with the run's own groups.
    for version in (served("other", 31), "sglang-v1.2"):
        await publish_groups(js, topology, 1, version=version, prefix=f"x{version[:5]}")
    flat = [
        one_call_group(
            g,
            run=RUN,
            agent=AGENT,
            job_id=lambda g, i: f"flat{g}-{i}",
            group_id=f"flat{g}",
            reward=lambda g, i: 0.0,
        )
        for g in range(2)
    ]
    for group in flat:  # first: when two groups with spread arrive, all 16 were received
        await publish(js, topology, group)
    await publish_groups(js, topology, 2, version="default", prefix="spread")
    trainer = Trainer(config(tmp_path, filter_flat_groups=True), js, topology=topology)
    async with asyncio.timeout(60):
        summary = await trainer.run(max_steps=1)
    assert summary.trained == 8 and summary.counters["invalid"] == 0
    assert summary.counters["foreign_weights"] == 8 and summary.counters["dropped_flat"] == 2
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert row["foreign_weights"] == "8"
    # the policy scored 2 of its 16 (the 8 of other weights are not its); the trained subset
    # (flat groups filtered) 2 of 8
    assert (row["reward_mean_received"], row["reward_mean_trained"]) == ("0.125", "0.25")
    assert (row[f"reward_mean_received/{AGENT}"], row[f"reward_mean_trained/{AGENT}"]) == (
        "0.125",
        "0.25",
    )


def _returns(value):
    async def latest_version():
        return value

    return latest_version


def test_cli_flags_map_to_config_and_bad_values_say_what_to_fix(tmp_path):
    parser = argparse.ArgumentParser()
    add_trainer_arguments(parser)
    help_text = parser.format_help()
    for flag in (
        "--max-staleness",
        "--stale-policy",
        "--loss-agg",
        "--no-std-norm",
        "--ray-workers",
        "--filter-flat-groups",
        "--publish-every",
        "--kl-coef",
        "--resume",
        "--metrics",
    ):
        assert flag in help_text
    args = parser.parse_args(
        [
            "--run",
            "r",
            "--agent",
            "a",
            "--model",
            str(ensure_tiny_model()),
            "--no-std-norm",
            "--stale-policy",
            "tis",
            "--clip-high",
            "0.28",
        ]
    )
    cfg = config_from_args(args)
    assert (cfg.std_norm, cfg.stale_policy, cfg.clip_high) == (False, "tis", 0.28)
    with pytest.raises(TrainerConfigError, match="--clip-low must be in"):
        config(tmp_path, clip_low=1.5)
    with pytest.raises(TrainerConfigError, match="no config.json"):
        config(tmp_path, model_dir=str(tmp_path))
    with pytest.raises(TrainerConfigError, match="run"):
        config(tmp_path, run="a.b")
