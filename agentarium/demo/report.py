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


TOOL_RATE = "rollout/called_tool"  # the tool agent's metric (examples/calculator_agent.py)


def rows_line(rows: Sequence[Mapping[str, str]], agent: str) -> str:
    """How the trainer built the run's multi-turn rollouts: one row each when their calls
    chained token for token (``multi_turn_rows``), a row per call when not
    (``prefix_mismatches``)."""
    column = task_column(list(rows[0]), agent, "trajectories") if agent else None
    trained = sum(int(r[column] or 0) for r in rows) if column else None
    chained = sum(int(r.get("multi_turn_rows") or 0) for r in rows)
    split = sum(int(r.get("prefix_mismatches") or 0) for r in rows)
    of = f" of {trained} trained" if trained is not None else ""
    return (
        f"multi-turn rollouts{of}: {chained} trained as one row each, {split} split into a row "
        "per call (prefix mismatches)"
    )


def plot_tool_agent(
    rows: Sequence[Mapping[str, str]], png_path: Path, held_out: Mapping[str, float]
) -> Path:
    """The tool agent's plot: the policy's exact answers and the fraction of rollouts that
    called the tool against the step, and the held-out evals (base at step 0, trained at the
    last step)."""
    from agentarium.trainer import step_figure

    title = "calculator agent: reward, tool use and held-out accuracy vs step"
    with step_figure(png_path, title) as ax:
        for column, label, colour in (
            (REWARD, "exact answers (the policy's rollouts)", "C0"),
            (TOOL_RATE, "rollouts that called the tool", "C1"),
        ):
            points = [(int(r["step"]), _number(r.get(column))) for r in rows]
            known = [(x, y) for x, y in points if y is not None]
            ax.plot([x for x, _ in known], [y for _, y in known], color=colour, label=label)
        last = int(rows[-1]["step"])
        marks = [(0, held_out.get("base")), (last, held_out.get("trained"))]
        shown = [(x, y) for x, y in marks if y is not None]
        if shown:
            ax.plot(
                [x for x, _ in shown], [y for _, y in shown], "o--", color="C2",
                label="held-out exact answers (base, trained)",
            )  # fmt: skip
            for x, y in shown:
                ax.annotate(f"{y:.2f}", (x, y), textcoords="offset points", xytext=(4, 6))
        ax.set_ylim(-0.02, 1.02)
    return png_path


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
    out: Path,
    elapsed: float,
    digits: str,
    tasks: Sequence[str],
    model: str = "tiny",
    *,
    agent: str = "",
    held_out: Mapping[str, float] | None = None,
) -> int:
    """Print the run's figures and write reward.png; 0 when at least one step was trained.
    ``held_out``: the demo's evals (label -> exact-answer rate), drawn on the tool agent's
    plot."""
    from agentarium.trainer import plot_metrics, read_metrics

    metrics = out / "metrics.csv"
    rows = read_metrics(metrics) if metrics.exists() else []
    if not rows:
        print("no training step completed: see the logs in", out / "logs")
        return 1
    tool_agent = TOOL_RATE in rows[0]
    if tool_agent:
        png = plot_tool_agent(rows, out / "reward.png", held_out or {})
    else:
        png = plot_metrics(metrics, out / "reward.png")
    print(f"{len(rows)} steps in {elapsed:.0f}s; policy version {rows[-1]['version']}")
    if tool_agent:
        n, first, last = first_last([_number(r.get(TOOL_RATE)) for r in rows])
        print(
            f"rollouts that called the tool: first {n} steps {first:.2f} -> last {n} steps "
            f"{last:.2f} (gain {last - first:+.2f})"
        )
        print(rows_line(rows, agent))
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
