"""What the demo prints at the end, and where a task's reward is in the trainer's metrics CSV.

The reward shown is the policy's, ``reward_mean_received`` (every ok trajectory received, not
only the trained ones). A trainer on several agents writes one such column per agent beside the
overall one. ``task_column`` finds it by the agent's name joined to the metric in either order
with one of ``/ _ : .`` (``reward_mean_received/next``, ``next_reward_mean_received``, ...), so
this module does not pin one spelling of the multi-agent trainer's columns; a trainer on one
agent has only the overall column, which is then that agent's.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from .tasks import FAMILIES

_SEPARATORS = ("/", "_", ":", ".")


REWARD = "reward_mean_received"


def task_column(columns: Sequence[str], task: str, metric: str = REWARD) -> str | None:
    """The column holding ``metric`` of agent ``task``, or None when the CSV has none."""
    wanted = {f"{metric}{s}{task}" for s in _SEPARATORS}
    wanted |= {f"{task}{s}{metric}" for s in _SEPARATORS} | {f"{metric}[{task}]"}
    found = [c for c in columns if c in wanted]
    return found[0] if found else None


def task_rewards(
    rows: Sequence[Mapping[str, str]], tasks: Sequence[str], metric: str = REWARD
) -> dict[str, list[float | None]]:
    """Each task's reward per step, one value per row: None where the step trained no group of
    the task. One task: the overall column. Several: each task's own column; a ValueError names
    the columns when a task has none (a trainer that trained one agent, or another spelling)."""
    if not rows:
        return {task: [] for task in tasks}
    columns = list(rows[0])
    if len(tasks) == 1:
        only = task_column(columns, tasks[0], metric) or metric
        return {tasks[0]: [_number(r.get(only)) for r in rows]}
    series: dict[str, list[float | None]] = {}
    for task in tasks:
        column = task_column(columns, task, metric)
        if column is None:
            raise ValueError(
                f"the metrics CSV has no {metric} column for task {task!r} (columns: "
                f"{', '.join(columns)}): was the trainer started with one --agent per task?"
            )
        series[task] = [_number(r.get(column)) for r in rows]
    return series


def _number(text: str | None) -> float | None:
    if text in (None, ""):
        return None
    value = float(text)
    return None if math.isnan(value) else value


def first_last(values: Sequence[float | None], window: int = 20) -> tuple[int, float, float]:
    """(n, mean of the first n steps, mean of the last n steps), n = min(window, half the
    steps) or 1; steps without a value (None) are left out of their window's mean."""
    n = min(window, len(values) // 2) or 1

    def mean(part: Sequence[float | None]) -> float:
        known = [v for v in part if v is not None]
        return sum(known) / len(known) if known else math.nan

    return n, mean(values[:n]), mean(values[-n:])


def report(
    out: Path, elapsed: float, digits: str, tasks: Sequence[str], model: str = "tiny"
) -> int:
    """Print the run's figures and write reward.png; 0 when at least one step was trained."""
    from agentarium.trainer import plot_metrics, read_metrics

    metrics = out / "metrics.csv"
    rows = read_metrics(metrics) if metrics.exists() else []
    if not rows:
        print("no training step completed: see the logs in", out / "logs")
        return 1
    png = plot_metrics(metrics, out / "reward.png")
    print(f"{len(rows)} steps in {elapsed:.0f}s; policy version {rows[-1]['version']}")
    if not tasks and model == "smol":  # few-shot addition: no constant policy to compare with
        n, first, last = first_last([_number(r.get(REWARD)) for r in rows])
        print(
            f"exact answers (the policy's, every rollout): first {n} steps {first:.2f} -> "
            f"last {n} steps {last:.2f} (gain {last - first:+.2f})"
        )
    elif not tasks:  # the single-task demo's historic line
        n, first, last = first_last([_number(r.get(REWARD)) for r in rows])
        print(
            f"accuracy: first {n} steps {first:.2f} -> last {n} steps {last:.2f} "
            f"(best constant policy: {1 / len(set(digits)):.2f}; gain {last - first:+.2f})"
        )
    else:
        try:
            series = task_rewards(rows, tasks)
        except ValueError as exc:
            print(f"per-task rewards unavailable: {exc}")
            series = {}
        for task, values in series.items():
            if all(v is None for v in values):
                print(f"{task}: no step trained on it")
                continue
            n, first, last = first_last(values)
            family = FAMILIES[task]
            print(
                f"{task}: reward first {n} steps {first:.2f} -> last {n} steps {last:.2f} "
                f"(range {family.reward_low:g}..{family.reward_high:g}; best constant policy "
                f"{family.best_constant(digits):.2f}; gain {last - first:+.2f})"
            )
    print(f"metrics: {metrics}")
    print(f"reward plot: {png}")
    return 0
