"""One policy learns two tasks at once through the real pipeline: ``agentarium demo --task-set
repeat,next`` (two agents, two consumers, one trainer started with ``--agent repeat --agent
next``) on a micro-task, fixed seeds: every answer is 7 (``repeat 7``, ``next 6``), so no
conditioning is needed, as in tests/test_learning.py. (With one prompt digit for both tasks the
answers would differ, 7 and 8, and a policy without an entropy bonus collapses onto one digit
for both prompts, which run decides by its seed: one task would rise and the other die.)

Each task's reward, read from its own column of the trainer's metrics CSV, must rise by at least
30% of the task's reward range (mean of the last 20 steps against the first 20, over the steps
that trained groups of the task); with learning rate 0 neither may rise.
"""

from __future__ import annotations

import subprocess
import sys

from agentarium.demo import FAMILIES, first_last, task_rewards
from trainer.metrics import read_metrics

TASKS = ("repeat", "next")
STEPS = 60  # two windows of 20 and room to learn between them
FROZEN_STEPS = 40
WINDOW = 20


def run_demo(out, *extra: str) -> dict[str, list[float | None]]:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "agentarium",
            "demo",
            "--task-set",
            ",".join(TASKS),
            "--out",
            str(out),
            "--digits",
            "7",
            "--groups-per-step",
            "8",
            "--group-size",
            "8",
            "--entropy-coef",
            "0",
            "--minutes",
            "5",
            "--seed",
            "1",
            "--run",
            "multitask",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=360,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return task_rewards(read_metrics(out / "metrics.csv"), TASKS)


def rise(values: list[float | None]) -> float:
    n, first, last = first_last(values, WINDOW)
    assert n == WINDOW, f"{len(values)} steps, need {2 * WINDOW}"
    return last - first


def test_each_task_rises_with_learning_and_not_without(tmp_path):
    learned = run_demo(tmp_path / "lr", "--lr", "3e-3", "--steps", str(STEPS))
    for task in TASKS:
        needed = 0.3 * FAMILIES[task].reward_range
        assert rise(learned[task]) >= needed, (task, rise(learned[task]), learned[task])

    frozen = run_demo(tmp_path / "lr0", "--lr", "0", "--steps", str(FROZEN_STEPS))
    for task in TASKS:
        limit = 0.1 * FAMILIES[task].reward_range
        assert rise(frozen[task]) < limit, (task, rise(frozen[task]), frozen[task])
    assert (tmp_path / "lr" / "reward.png").stat().st_size > 0
