"""Per-task metrics (trainer/metrics.py): CSV columns per agent after the whole step's, tracker
names under ``/``, empty when a task had nothing in a step, a resumed trainer's new agents
widening the file once, and one plot curve per task."""

from __future__ import annotations

import csv

import pytest

from agentarium.trainer.metrics import (
    COLUMNS,
    FIELDS,
    MetricsSink,
    StepMetrics,
    TaskMetrics,
    plot_metrics,
    read_metrics,
    task_columns,
)


def step(n: int, **tasks: TaskMetrics) -> StepMetrics:
    return StepMetrics(step=n, version=n - 1, reward_mean_received=0.5, tasks=dict(tasks))


def test_columns_and_tracker_names_per_task():
    m = step(
        1,
        a=TaskMetrics(
            groups=2, trajectories=8, reward_mean_received=0.25, success=0.25, length=3.0
        ),
        b=TaskMetrics(dropped_stale=4, dropped_groups=1),  # nothing of b in this step
    )
    row = m.as_row()
    assert list(row)[: len(COLUMNS)] == list(COLUMNS)
    assert list(row) == [*FIELDS, *task_columns(["a", "b"])]
    assert (row["reward_mean_received/a"], row["success/a"], row["length/a"]) == (0.25, 0.25, 3.0)
    assert (row["reward_mean_received/b"], row["groups/b"], row["dropped_stale/b"]) == ("", 0, 4)
    scalars = m.scalars()
    assert scalars["reward/mean"] == 0.5 and scalars["reward/mean/a"] == 0.25
    assert scalars["reward/success/a"] == 0.25 and scalars["response/length/a"] == 3.0
    assert scalars["dropped/stale/b"] == 4 and scalars["dropped/groups/b"] == 1
    assert "reward/mean/b" not in scalars  # an empty value is not a point at 0


def test_a_resumed_trainer_with_another_agent_widens_the_csv_once(tmp_path):
    path = tmp_path / "m.csv"
    sink = MetricsSink(path, tasks=["a", "b"])
    sink.record(step(1, a=TaskMetrics(groups=1, reward_mean_received=1.0), b=TaskMetrics()))
    sink.close()
    sink = MetricsSink(path, tasks=["a", "b", "c"], append=True)
    sink.record(
        step(2, a=TaskMetrics(), b=TaskMetrics(), c=TaskMetrics(groups=1, reward_mean_received=0.0))
    )
    sink.close()
    with path.open(newline="") as f:
        header = next(csv.reader(f))
    assert header == [*FIELDS, *task_columns(["a", "b", "c"])]
    rows = read_metrics(path)
    assert [(r["reward_mean_received/a"], r["reward_mean_received/c"]) for r in rows] == [
        ("1.0", ""),
        ("", "0.0"),
    ]
    # the same agents again: appended under the same header, nothing rewritten
    sink = MetricsSink(path, tasks=["a"], append=True)
    sink.record(step(3, a=TaskMetrics(groups=1, reward_mean_received=0.5)))
    sink.close()
    assert [r["reward_mean_received/a"] for r in read_metrics(path)] == ["1.0", "", "0.5"]


def test_the_plot_draws_one_curve_per_task_in_one_figure(tmp_path, monkeypatch):
    path = tmp_path / "m.csv"
    sink = MetricsSink(path, tasks=["math", "code"])
    for n in range(1, 61):
        code = TaskMetrics(reward_mean_received=n / 60) if n % 3 else TaskMetrics()  # gaps: skipped
        sink.record(step(n, math=TaskMetrics(reward_mean_received=1 - n / 60), code=code))
    sink.close()
    import matplotlib.axes

    labels: list[str] = []
    plot = matplotlib.axes.Axes.plot

    def recording(self, *args, **kwargs):
        if kwargs.get("label"):
            labels.append(kwargs["label"])
        return plot(self, *args, **kwargs)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", recording)
    png = plot_metrics(path, tmp_path / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    assert labels == ["math", "code"]  # each task's moving mean, over its faint steps
    labels.clear()
    plot_metrics(path, tmp_path / "len.png", column="loss")  # no per-task form: one curve
    assert labels == ["loss", "loss (mean of 3)"]
    with pytest.raises(ValueError, match="no column 'nope'"):
        plot_metrics(path, tmp_path / "x.png", column="nope")


async def test_broker_status_shows_the_trainers_latest_figures_per_task(js, topology):
    """`broker status` reads the trainer's last row from <p>.metrics.<run> (the live stream
    the trainer publishes each step) and lists the per-task figures."""
    from agentarium.broker import collect_status, format_status
    from agentarium.trainer.live import LiveMetrics

    live = LiveMetrics(js, topology, run="mt", agent="a+b")
    first = step(1, a=TaskMetrics(groups=1, reward_mean_received=0.1), b=TaskMetrics())
    assert await live.publish(first)
    latest = step(
        2,
        a=TaskMetrics(groups=2, trajectories=8, reward_mean_received=0.75, success=0.5, length=3.0),
        b=TaskMetrics(dropped_stale=4, dropped_groups=1),  # nothing of b in this step
    )
    assert await live.publish(latest)
    status = await collect_status(js, topology, runs=("mt",))
    assert status.trainer["mt"]["step"] == 2
    text = format_status(status)
    assert "trainer mt: step 2, version 1" in text
    [a_line] = [line for line in text.splitlines() if line.strip().startswith("a ")]
    assert a_line.split()[1:] == ["0.750", "0.500", "3.000", "0", "0"]
    [b_line] = [line for line in text.splitlines() if line.strip().startswith("b ")]
    assert b_line.split()[1:] == ["-", "-", "-", "4", "1"]


def test_the_agents_own_metrics_become_columns_the_first_step_that_reports_them(tmp_path):
    """An agent's ``metrics`` (tool calls, turns) are ``rollout/<name>``: the file gains the
    column at the first step that has it (earlier rows keep an empty cell), a step without it
    leaves its cell empty, and trackers get the same names."""
    path = tmp_path / "m.csv"
    sink = MetricsSink(path)
    sink.record(step(1))
    sink.record(StepMetrics(step=2, version=1, rollout={"tool_calls": 1.5, "called_tool": 0.75}))
    sink.record(step(3))
    sink.record(StepMetrics(step=4, version=3, rollout={"called_tool": 1.0}))
    sink.close()
    with path.open(newline="") as f:
        header = next(csv.reader(f))
    assert header == [*FIELDS, "rollout/called_tool", "rollout/tool_calls"]
    rows = read_metrics(path)
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    assert [r["rollout/called_tool"] for r in rows] == ["", "0.75", "", "1.0"]
    assert [r["rollout/tool_calls"] for r in rows] == ["", "1.5", "", ""]
    scalars = StepMetrics(step=2, version=1, rollout={"turns": 2.0}).scalars()
    assert scalars["rollout/turns"] == 2.0
