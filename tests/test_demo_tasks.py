"""The demo's task sets (agentarium/demo/tasks.py, report.py, run.py): tasks, agents, the trainer's
arguments, per-task rewards from the metrics CSV, and the refusals, without starting a process.
Every draw is from a seeded ``random.Random`` (the same on every machine) and every assertion on
drawn tasks holds for any draw (a held-out pair is never trained on): no chance failures."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from agentarium.demo import (
    FAMILIES,
    DemoConfig,
    first_last,
    task_column,
    task_rewards,
)
from agentarium.demo.run import _step_batches, trainer_argv
from agentarium.demo.tasks import digit_tasks, split_groups
from agentarium.examples.toy import digit_credit, next_digit, rollout


def test_the_single_task_demo_is_unchanged():
    config = DemoConfig(run="r")
    assert config.task_set == () and config.agents() == {"toy": "agentarium.examples.toy:rollout"}
    [(agent, tasks)] = _step_batches(config, random.Random(0), 0)
    # the task stream the demo always fed: "repeat d" -> d, one rng draw per task, ids b<n>-<i>
    rng = random.Random(0)
    expected = [rng.choice("0123456789") for _ in range(16)]
    assert agent == "toy"
    assert [t["prompt"] for t in tasks] == [f"repeat {d}" for d in expected]
    assert [t["answer"] for t in tasks] == expected
    assert [t["task_id"] for t in tasks] == [f"b0-{i}" for i in range(16)]
    argv = trainer_argv(config, Path("/m"), Path("/o"), "nats://x")
    assert argv.count("--agent") == 1 and argv[argv.index("--agent") + 1] == "toy"
    assert "--task-adv-norm" not in argv


def test_a_task_set_feeds_each_agent_its_share_and_trains_them_together():
    config = DemoConfig(run="r", task_set="repeat,next", groups_per_step=5, task_adv_norm="token")
    assert config.task_set == ("repeat", "next")
    assert config.agents() == {
        "repeat": "agentarium.examples.toy:rollout",
        "next": "agentarium.examples.toy:next_digit",
    }
    batches = dict(_step_batches(config, random.Random(0), 10))
    assert {k: len(v) for k, v in batches.items()} == {"repeat": 3, "next": 2}
    assert all(t["task_id"].startswith(f"{k}-b10-") for k, v in batches.items() for t in v)
    for task in batches["next"]:
        assert task["prompt"] == f"next {(int(task['answer']) - 1) % 10}"
    argv = trainer_argv(config, Path("/m"), Path("/o"), "nats://x")
    agents = [argv[i + 1] for i, word in enumerate(argv) if word == "--agent"]
    assert agents == ["repeat", "next"]
    assert argv[argv.index("--task-adv-norm") + 1] == "token"


def test_one_digit_makes_every_task_answer_it():
    for family in FAMILIES:
        tasks = digit_tasks(random.Random(1), 4, "p", "7", family)
        assert {t["answer"] for t in tasks} == {"7"}
    assert digit_tasks(random.Random(1), 1, "p", "0", "next")[0]["prompt"] == "next 9"


def test_split_and_best_constant():
    assert split_groups(16, ("repeat", "next")) == {"repeat": 8, "next": 8}
    assert split_groups(3, ("a", "b")) == {"a": 2, "b": 1}
    assert FAMILIES["repeat"].best_constant("0123456789") == pytest.approx(0.1)
    assert FAMILIES["next"].best_constant("0123456789") == pytest.approx(0.2)  # 1 + 2 x 0.5
    assert FAMILIES["next"].best_constant("7") == 1.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"task_set": "repeat,nope"}, "unknown task 'nope'"),
        ({"task_set": "next,next"}, "names a task twice"),
        ({"task_set": "repeat,next", "groups_per_step": 1}, "at least the number of tasks"),
        ({"task_adv_norm": "group"}, "--task-adv-norm must be one of none, token, trajectory"),
        ({"task_set": "next", "rollouts_only": True}, "drop --task-set"),
        ({"recipe": "calc"}, "--recipe calc is a recipe of --model smol"),
        ({"model": "smol", "recipe": "sum"}, "recipe"),
    ],
)
def test_bad_task_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DemoConfig(run="r", **kwargs)


def test_per_task_columns_and_windows():
    assert (
        task_column(["step", "reward_mean_received", "reward_mean_received/next"], "next")
        == "reward_mean_received/next"
    )
    assert task_column(["next_reward_mean_received"], "next") == "next_reward_mean_received"
    assert task_column(["reward_mean_received/repeat"], "next") is None
    rows = [
        {
            "step": "1",
            "reward_mean_received": "0.5",
            "reward_mean_received/repeat": "0.0",
            "reward_mean_received/next": "1",
        },
        {
            "step": "2",
            "reward_mean_received": "0.5",
            "reward_mean_received/repeat": "1.0",
            "reward_mean_received/next": "",
        },
    ]
    series = task_rewards(rows, ("repeat", "next"))
    assert series == {"repeat": [0.0, 1.0], "next": [1.0, None]}
    assert task_rewards(rows, ("next",)) == {"next": [1.0, None]}  # its own column wins
    assert task_rewards([{"reward_mean_received": "0.25"}], ("repeat",)) == {"repeat": [0.25]}
    with pytest.raises(ValueError, match="no reward_mean_received column for task 'next'"):
        task_rewards(
            [{"reward_mean_received": "0.5", "reward_mean_received/repeat": "0"}],
            ("repeat", "next"),
        )
    assert first_last([0.0, None, 1.0, 1.0], window=2) == (2, 0.0, 1.0)


class OneReply:
    def __init__(self, text: str) -> None:
        self.text = text

    async def chat(self, messages, **_):
        return self


def test_next_digit_pays_graded_credit():
    task = {"prompt": "next 3", "answer": "4", "max_new_tokens": 1}
    rewards = {
        reply: asyncio.run(next_digit(task, OneReply(reply)))["reward"]
        for reply in ("4", "3", "5", "7", "x", "")
    }
    assert rewards == {"4": 1.0, "3": 0.5, "5": 0.5, "7": 0.0, "x": 0.0, "": 0.0}
    assert digit_credit("9", "0") == digit_credit("1", "0") == 0.5  # around the dial
    assert asyncio.run(rollout({"prompt": "repeat 3", "answer": "3"}, OneReply("3")))["reward"] == 1


def test_the_real_model_demo_trains_addition_with_its_own_defaults():
    from agentarium.examples.arithmetic import add_tasks, eval_tasks, held_out, messages_of

    config = DemoConfig(run="r", model="smol")
    assert (config.agent_name, config.agent) == ("add", "agentarium.examples.arithmetic:rollout")
    assert (config.lr, config.entropy_coef, config.steps, config.groups_per_step) == (
        1e-5,
        0.0,
        20,
        8,
    )
    assert DemoConfig(run="r", model="smol", lr=3e-6, steps=5).lr == 3e-6
    assert DemoConfig(run="r").lr == 1e-3  # tiny keeps its own
    [(agent, tasks)] = _step_batches(config, random.Random(0), 0)
    assert agent == "add" and len(tasks) == 8
    assert all(t["answer"] == str(t["a"] + t["b"]) for t in tasks)
    held = eval_tasks()
    assert len(held) == 20 and all(held_out(t["a"], t["b"]) for t in held)
    trained = add_tasks(random.Random(1), 500, "p")
    assert not any(held_out(t["a"], t["b"]) for t in trained)  # never trained on
    assert [m["role"] for m in messages_of(held[0])] == [
        "system",
        *["user", "assistant"] * 2,
        "user",
    ]
    with pytest.raises(ValueError, match="drop it with --model smol"):
        DemoConfig(run="r", model="smol", task_set="repeat,next")


def test_the_calculator_recipe_feeds_its_agent_with_lora_and_the_tool_fallback():
    """``--model smol --recipe calc``: the calculator agent, its training problems (none held
    out), rank-16 LoRA unless told otherwise, and the tool fallback on the consumers."""
    from agentarium.examples.calculator_agent import answer_of, held_out

    config = DemoConfig(run="r", model="smol", recipe="calc")
    assert config.agents() == {"calc": "agentarium.examples.calculator_agent:rollout"}
    assert (config.lora_rank, config.lr, config.steps, config.groups_per_step) == (16, 3e-4, 12, 2)
    assert config.preset.tool_fallback and config.preset.held_out_eval
    [(agent, tasks)] = _step_batches(config, random.Random(0), 3)
    assert agent == "calc" and len(tasks) == 2
    for task in tasks:
        assert not held_out(task["a"], task["op"], task["b"])
        assert task["answer"] == answer_of(task["a"], task["op"], task["b"])
    evals = config.preset.eval_tasks()
    assert len(evals) == 40 and len({t["task_id"] for t in evals}) == 40
    assert all(held_out(t["a"], t["op"], t["b"]) for t in evals)
    argv = trainer_argv(config, Path("/m"), Path("/o"), "nats://x")
    assert argv[argv.index("--lora-rank") + 1] == "16"
    assert argv[argv.index("--max-tokens-per-micro-batch") + 1] == "4096"
    assert DemoConfig(run="r", model="smol", recipe="calc", lora_rank=0).lora_rank == 0
    assert DemoConfig(run="r", model="smol").lora_rank == 0  # the addition keeps its defaults


def test_engine_vllm_starts_vllm_with_lora_when_the_demo_trains_adapters():
    """``--engine vllm``: the demo starts ``agentarium engine --backend vllm`` (with runtime
    LoRA loading when it trains adapters) instead of the local engine; anything but ``vllm`` or
    an http(s) URL is refused before anything starts."""
    from agentarium.demo.run import engine_argv

    local = engine_argv(DemoConfig(run="r"), Path("/m"))
    assert local == ["engine", "--model", "/m", "--port", "0"]
    full = engine_argv(DemoConfig(run="r", model="smol", engine="vllm"), Path("/m"))
    assert full == [*local, "--backend", "vllm"]
    lora = engine_argv(DemoConfig(run="r", model="smol", engine="vllm", lora_rank=8), Path("/m"))
    assert lora == [*full, "--vllm-arg=--enable-lora", "--vllm-arg=--max-lora-rank=8"]
    # vLLM takes only some ranks (1, 8, 16, 32, ...): the next one up holds the adapter
    odd = engine_argv(DemoConfig(run="r", model="smol", engine="vllm", lora_rank=12), Path("/m"))
    assert odd[-1] == "--vllm-arg=--max-lora-rank=16"
    with pytest.raises(ValueError, match="LoRA ranks up to 512, not 600"):
        DemoConfig(run="r", model="smol", engine="vllm", lora_rank=600)
    for bad in ("vLLM", "127.0.0.1:8000", "sglang"):
        with pytest.raises(ValueError, match="--engine takes vllm or an http"):
            DemoConfig(run="r", engine=bad)


def test_vllm_loads_adapters_at_run_time_only_when_started_with_lora():
    """``--enable-lora`` among vLLM's arguments turns on the switch without which its
    ``/v1/load_lora_adapter`` (the syncer's adapter path) answers 404."""
    from agentarium.inference import vllm_command

    argv, env = vllm_command("py", "/m", served_name="m", host="h", port=1, gpu=False)
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" not in env and "--enable-lora" not in argv
    argv, env = vllm_command(
        "py", "/m", served_name="m", host="h", port=1, gpu=False, extra=["--enable-lora"]
    )
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "1" and argv[-1] == "--enable-lora"


def test_with_vllm_an_untied_output_head_gets_no_adapter(tiny_dir, tmp_path):
    """vLLM refuses a LoRA adapter on an output head of its own (the tiny model's), so the demo
    leaves ``lm_head`` out there, and keeps it on a tied head and on the local engine."""
    import json

    from agentarium.demo.run import LORA_TARGETS, lora_targets

    with_vllm = DemoConfig(run="r", engine="vllm", lora_rank=8)
    assert json.loads((tiny_dir / "config.json").read_text())["tie_word_embeddings"] is False
    assert lora_targets(with_vllm, tiny_dir) == tuple(t for t in LORA_TARGETS if t != "lm_head")
    assert lora_targets(DemoConfig(run="r", lora_rank=8), tiny_dir) == LORA_TARGETS
    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    assert lora_targets(with_vllm, tmp_path) == LORA_TARGETS
    argv = trainer_argv(with_vllm, tiny_dir, Path("/o"), "nats://x")
    assert "lm_head" not in argv and "q_proj" in argv


def test_the_calculator_plot_is_written_and_leaves_no_figure_open(tmp_path):
    import matplotlib.pyplot as plt

    from agentarium.demo.report import REWARD, TOOL_RATE, plot_tool_agent

    rows = [{"step": str(s), REWARD: str(s / 10), TOOL_RATE: "" if s == 3 else "0.5"}
            for s in range(10)]  # fmt: skip
    png = plot_tool_agent(rows, tmp_path / "deep" / "reward.png", {"base": 0.1, "trained": 0.8})
    assert png == tmp_path / "deep" / "reward.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert plt.get_fignums() == []  # closed: a long demo process leaks no figures
