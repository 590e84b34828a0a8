"""One trainer, several agents, on a real nats-server with the tiny model: one durable consumer
per agent, batches composed by the task mix, a task that never (or only later) delivers does
not stall steps, per-task metrics, exactly-once across a crash, and ``--agent '*'``."""

from __future__ import annotations

import argparse
import asyncio
from collections import Counter

import pytest
import torch
from trainlib import publish, served, tiny_config

from agentarium.broker import provision
from agentarium.commands import trainer_cmd
from agentarium.schemas import LLMCall, Trajectory
from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.checkpoint import Checkpoints
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.errors import TrainerConfigError
from agentarium.trainer.loop import Trainer
from agentarium.trainer.metrics import plot_metrics, read_metrics
from agentarium.trainer.tasks import discover_agents

torch.set_num_threads(1)
RUN = "multi"


def group(
    agent: str, g: int, rewards: list[float], *, run: str = RUN, version: str = "default"
) -> list[Trajectory]:
    out = []
    for i, reward in enumerate(rewards):
        call = LLMCall(
            prompt_ids=[257, 48 + g % 10, 258],
            response_ids=[48 + i, 49, 258],  # 3 response tokens
            response_logprobs=[-5.5, -5.6, -5.5],
            finish_reason="stop",
            weight_version=version,
        )
        out.append(
            Trajectory(
                job_id=f"{agent}-{g}-{i}",
                agent=agent,
                task_id=f"{agent}-t{g}",
                group_id=f"{agent}-g{g}",
                group_size=len(rewards),
                run=run,
                status="ok",
                reward=reward,
                calls=[call],
            )
        )
    return out


# "math" scores 0/1, "code" on a larger scale: the task normalisation has work to do
MATH = [1.0, 0.0, 0.0, 0.0]
CODE = [10.0, 0.0, 5.0, 0.0]


def config(tmp_path, **overrides) -> TrainerConfig:
    values = dict(run=RUN, agents=("math", "code"), metrics_path=str(tmp_path / "metrics.csv"))
    return tiny_config(**{**values, **overrides})


class StepHook:
    """A WeightPublisher that runs ``actions[step]`` after that step (publish_every = 1)."""

    def __init__(self, actions=None, *, latest: int | None = None) -> None:
        self.actions = actions or {}
        self.latest = latest

    async def latest_version(self) -> int | None:
        return self.latest

    async def publish(self, model, version: int, step: int) -> None:
        action = self.actions.get(step)
        if action is not None:
            await action()


async def test_two_agents_train_one_policy_each_on_its_own_consumer(js, topology, tmp_path):
    for g in range(4):
        await publish(js, topology, group("math", g, MATH) + group("code", g, CODE))
    cfg = config(tmp_path, task_mix="balanced", task_adv_norm="token")
    summary = await Trainer(cfg, js, topology=topology).run(max_steps=4)
    assert (summary.steps, summary.trained) == (4, 32)
    assert {a: c["groups_used"] for a, c in summary.tasks.items()} == {"math": 4, "code": 4}

    for agent in ("math", "code"):
        info = await js.consumer_info(topology.trajectories_stream, f"trainer-{RUN}-{agent}")
        assert info.config.filter_subject == f"agentarium.trajectories.{RUN}.{agent}.*"
        assert info.config.max_ack_pending == cfg.max_ack_pending  # each its own
        assert info.num_ack_pending == 0 and info.num_pending == 0

    rows = read_metrics(tmp_path / "metrics.csv")
    assert len(rows) == 4
    for row in rows:  # balanced: one group of each agent in every step of two
        assert (row["groups/math"], row["groups/code"]) == ("1", "1")
        assert (row["trajectories/math"], row["trajectories/code"]) == ("4", "4")
        assert (row["reward_mean_trained/math"], row["reward_mean_trained/code"]) == (
            "0.25",
            "3.75",
        )
        assert (row["success/math"], row["success/code"]) == ("0.25", "0.5")
        assert (row["length/math"], row["length/code"]) == ("3.0", "3.0")
        assert (row["dropped_stale/math"], row["dropped_groups/code"]) == ("0", "0")
        assert row["reward_mean_trained"] == "2.0" and row["groups_used"] == "2"  # the whole step
    png = plot_metrics(tmp_path / "metrics.csv", tmp_path / "reward.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


async def test_a_task_that_never_delivers_does_not_stall_steps_and_joins_when_it_does(
    js, topology, tmp_path
):
    await publish(js, topology, [t for g in range(8) for t in group("math", g, MATH)])

    async def code_arrives_late() -> None:
        await publish(js, topology, [t for g in range(3) for t in group("code", g, CODE)])

    cfg = config(tmp_path, task_mix="balanced", task_wait_s=1.0)
    trainer = Trainer(cfg, js, topology=topology, publisher=StepHook({2: code_arrives_late}))
    async with asyncio.timeout(60):
        summary = await trainer.run(max_steps=5)
    assert summary.steps == 5
    rows = read_metrics(tmp_path / "metrics.csv")
    took = [(r["groups/math"], r["groups/code"]) for r in rows]
    # steps 1-2: code has nothing, its share goes to math after the bounded wait; from step 3
    # code's groups are there and the mix is balanced again
    assert took == [("2", "0"), ("2", "0"), ("1", "1"), ("1", "1"), ("1", "1")]
    assert rows[0]["reward_mean_trained/code"] == "" and rows[0]["success/code"] == ""
    for row in rows[:2]:
        assert 1.0 <= float(row["wait_s"]) < 10.0  # waited for code, but only task_wait_s
    assert float(rows[3]["wait_s"]) < 1.0  # both had their share ready: no wait


async def test_staleness_is_judged_per_trajectory_and_counted_per_task(js, topology, tmp_path):
    # the policy is at version 3 (a predecessor published it); code's first two groups were
    # sampled by version 0: 3 versions behind, past --max-staleness 1
    await publish(js, topology, [t for g in range(2) for t in group("code", g, CODE)])
    fresh = [
        group("math", g, MATH, version=served(RUN, 3))
        + group("code", g + 2, CODE, version=served(RUN, 3))
        for g in range(2)
    ]
    await publish(js, topology, [t for pair in fresh for t in pair])
    cfg = config(tmp_path, task_mix="balanced", max_staleness=1, task_wait_s=5.0)
    trainer = Trainer(cfg, js, topology=topology, publisher=StepHook(latest=3))
    summary = await trainer.run(max_steps=1)
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert (row["groups/math"], row["groups/code"]) == ("1", "1")  # code's fresh group
    assert (row["dropped_stale/code"], row["dropped_groups/code"]) == ("8", "2")
    assert (row["dropped_stale/math"], row["dropped_groups/math"]) == ("0", "0")
    assert row["dropped_stale"] == "8" and summary.tasks["code"]["dropped_stale_groups"] == 2
    assert float(row["wait_s"]) < 5.0  # code's share was met by its fresh group: no full wait


async def test_a_crash_then_resume_trains_every_trajectory_of_every_agent_once(
    js, topology, tmp_path
):
    batch = [t for g in range(3) for t in group("math", g, MATH) + group("code", g, CODE)]
    await publish(js, topology, batch)

    async def crash() -> None:
        raise RuntimeError("killed after step 3, before its checkpoint")

    ckpt = str(tmp_path / "ckpt")
    first = Trainer(
        config(tmp_path, checkpoint_dir=ckpt, checkpoint_every=2),
        js,
        topology=topology,
        publisher=StepHook({3: crash}),
    )
    with pytest.raises(RuntimeError, match="killed after step 3"):
        await first.run(max_steps=3)
    (state,) = Checkpoints(ckpt).history()
    assert state["step"] == 2 and state["agents"] == ["math", "code"]
    assert state["consumers"] == {a: f"trainer-{RUN}-{a}" for a in ("math", "code")}

    second = Trainer(
        config(tmp_path, checkpoint_dir=ckpt, checkpoint_every=2),
        js,
        topology=topology,
        resume=True,
    )
    assert (await second.run(max_steps=3)).steps == 3
    trained = Counter(j for h in Checkpoints(ckpt).history() for j in h["trained_job_ids"])
    assert set(trained) == {t.job_id for t in batch} and max(trained.values()) == 1
    for agent in ("math", "code"):
        info = await js.consumer_info(topology.trajectories_stream, f"trainer-{RUN}-{agent}")
        assert info.num_ack_pending == 0 and info.num_pending == 0
    # a checkpoint of other agents is another run's directory
    other = Trainer(
        config(tmp_path, agents=("chat",), checkpoint_dir=ckpt), js, topology=topology, resume=True
    )
    with pytest.raises(TrainerConfigError, match="belongs to run"):
        await other.run(max_steps=4)


async def test_every_agent_of_the_run_with_a_star(js, topology, tmp_path):
    with pytest.raises(TrainerConfigError, match=f"found no agent for run '{RUN}'"):
        await Trainer(config(tmp_path, agents=("*",)), js, topology=topology).run(1)
    await publish(js, topology, group("math", 0, MATH) + group("code", 0, CODE))
    await publish(js, topology, group("chat", 0, MATH, run="elsewhere"))  # another run's agent
    await provision(js, topology, agents=("search",))  # a rollout consumer for "search"
    assert await discover_agents(js, topology, RUN) == ["code", "math", "search"]
    assert await discover_agents(js, topology, RUN, also=["zeta", "*"]) == [
        "zeta",
        "code",
        "math",
        "search",
    ]
    trainer = Trainer(config(tmp_path, agents=("*",)), js, topology=topology)
    summary = await trainer.run(max_steps=1)
    assert trainer.agents == ("code", "math", "search") and summary.trained == 8
    assert set(summary.tasks) == {"code", "math", "search"}
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert (row["groups/code"], row["groups/math"], row["groups/search"]) == ("1", "1", "0")


def test_flags_and_config_keys_name_the_agents_the_mix_and_the_norm(tmp_path):
    parser = argparse.ArgumentParser()
    trainer_cmd.add_trainer_arguments(parser)
    model = str(ensure_tiny_model())
    base = ["--run", "r", "--model", model]
    args = parser.parse_args(
        [*base, "--agent", "a", "--agent", "b", "--task-mix", "a=2,b=1", "--task-wait", "5"]
        + ["--task-adv-norm", "token", "--success-threshold", "0.5"]
    )
    cfg, _, resolved = trainer_cmd.resolve_args(args)
    assert (cfg.agents, cfg.agent, cfg.label) == (("a", "b"), "", "a+b")
    assert (cfg.task_mix, cfg.task_wait_s, cfg.task_adv_norm) == ("a=2,b=1", 5.0, "token")
    assert cfg.success_threshold == 0.5
    one, _, _ = trainer_cmd.resolve_args(parser.parse_args([*base, "--agent", "toy"]))
    assert (one.agents, one.agent, one.task_mix) == (("toy",), "toy", "proportional")

    file = tmp_path / "t.yaml"
    file.write_text("run: r\nagent: toy\nmodel_dir: tiny\n")
    # a flag names the agents over a file's one-agent key (flags > file), in the record too
    cfg, _, resolved = trainer_cmd.resolve_args(
        parser.parse_args(["--config", str(file), "--agent", "b", "--agent", "c"])
    )
    assert cfg.agents == ("b", "c") and resolved.values["agent"] == ""
    file.write_text("run: r\nagents: [a, b]\nmodel_dir: tiny\ntask_mix: balanced\n")
    cfg, _, _ = trainer_cmd.resolve_args(parser.parse_args(["--config", str(file)]))
    assert (cfg.agents, cfg.task_mix) == (("a", "b"), "balanced")
    for argv, message in (
        ([*base, "--agent", "a", "--task-mix", "a=1,b=1"], "b not trained"),
        ([*base], "no agent to train"),
        ([*base, "--agent", "a", "--task-wait", "-1"], "--task-wait must be >= 0"),
    ):
        with pytest.raises(TrainerConfigError, match=message):
            trainer_cmd.resolve_args(parser.parse_args(argv))
