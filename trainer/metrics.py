"""Per-step training metrics: one CSV row per step, the same values as OpenTelemetry metrics
and as experiment-tracker scalars (trainer/trackers.py), and a PNG plot of reward against step.

Columns (in this order; the first ones are the stable contract):

    step, version, reward_mean_received, reward_mean_trained, reward_std, loss, kl, clip_frac,
    entropy, tokens, tokens_per_s,
    step_s, groups_used, dropped_stale, dropped_flat, staleness_max, staleness_mean,
    staleness_hist, then extras (model_tokens, rows, grad_norm, ratio_mean, wait_s, tis_weighted,
    prefix_mismatches, multi_turn_rows, failed_members, refused, validation_skipped, drawn, overlong,
    stale_masked, foreign_weights, stale_policy, time).

``version`` is the policy version the step's data was judged against (the update it makes is
published as the next version). Two rewards, named apart: ``reward_mean_received`` is the
policy's, the mean over every ok trajectory the trainer received since the previous step (those
later dropped as flat, stale or late included; empty when none arrived), and
``reward_mean_trained`` (with ``reward_std``) the mean over the trajectories the step trained on,
which ``--filter-flat-groups`` and stale drops make another population. ``tokens`` counts every real token of the batch (prompts too:
what the forward pass processes), ``tokens_per_s`` divides it by ``step_s`` (batch building
and the update, not the wait for data). ``dropped_*``, ``tis_weighted``, ``stale_masked``,
``failed_members``, ``refused``, ``foreign_weights`` and
``validation_skipped`` are running totals, since drops happen between steps.
``multi_turn_rows`` counts the step's multi-call trajectories trained as one row (their calls
chained token for token), ``prefix_mismatches`` those that fell back to a row per call. ``drawn`` is the
step's replacement groups (dynamic sampling: what producers published for the groups it
dropped); ``overlong`` the running total of responses cut at max_new_tokens that were filtered
or given the set reward. What became of too-stale trajectories follows ``stale_policy`` (the
trainer's ``--stale-policy``, named in every row): ``dropped_stale`` (drop), ``tis_weighted``
(tis) or ``stale_masked`` (mask); ``foreign_weights`` counts trajectories sampled by weights
that are not the run's (another run's, or a version string no trainer of it wrote), never
trained. The staleness columns cover every ok trajectory weighed for the step (trained or not)
and count each generated token by its own version (``LLMCall.weight_spans``):
``staleness_max`` is the oldest token's, ``staleness_mean`` the mean over the tokens, and
``staleness_hist`` reads ``0:96 1:24 3:8`` (versions behind: trajectories, each by its oldest
token).

Per task (an agent; a trainer may train several), after those columns, for every trained agent
in the order trained: ``groups/<agent>``, ``trajectories/<agent>`` (this step's share),
``reward_mean_received/<agent>`` and ``reward_mean_trained/<agent>`` (as above, that task's),
``success/<agent>`` (of the trained ones, the fraction with reward >= ``--success-threshold``),
``length/<agent>`` (mean response tokens, every call's), all empty when the task had no
trajectory in the step, and the running totals ``dropped_stale/<agent>`` (trajectories) and
``dropped_groups/<agent>`` (too few ok members, flat, every member stale), then this step's
``drawn/<agent>``. A resumed trainer
whose agents changed rewrites the file once with the union of the columns.

Then the agents' own metrics (each trajectory's ``metrics``: ``tool_calls``, ``turns``, ...):
``rollout/<name>``, the mean over the step's trained trajectories that report it, empty in a
step where none did. The first step that reports a name rewrites the file once with the new
column (earlier rows keep an empty cell); trackers get the same ``rollout/<name>``.

Trackers (TensorBoard, W&B, MLflow) get the same values under verl-style ``/``-grouped names,
identical in every tracker: ``TRACKER_NAMES`` maps each CSV column to its name
(``reward_mean_received`` -> ``reward/mean``, ``reward_mean_trained`` -> ``reward/mean_trained``). ``staleness_hist`` and ``time`` have no scalar form there
(``staleness/max`` and ``staleness/mean`` summarise the first; trackers stamp their own time),
nor has ``stale_policy`` (a name).
Per-task values go under ``TASK_TRACKER_NAMES`` + ``/<agent>`` (``reward/mean/toy``), so each
tracker shows the tasks side by side in one panel; an empty value is not logged.

A resumed trainer appends to the same CSV, so steps trained after the last checkpoint of a
killed trainer appear twice; ``read_metrics`` keeps the last row of each step.
"""

from __future__ import annotations

import contextlib
import csv
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opentelemetry import metrics as otel_metrics

from .trackers import NullTracker, Tracker

COLUMNS = (
    "step",
    "version",
    "reward_mean_received",
    "reward_mean_trained",
    "reward_std",
    "loss",
    "kl",
    "clip_frac",
    "entropy",
    "tokens",
    "tokens_per_s",
    "step_s",
    "groups_used",
    "dropped_stale",
    "dropped_flat",
    "staleness_max",
    "staleness_mean",
    "staleness_hist",
)


@dataclass
class TaskMetrics:
    """One task's (agent's) share of a step; None where it had no trajectory in the step."""

    groups: int = 0
    trajectories: int = 0
    reward_mean_received: float | None = None
    reward_mean_trained: float | None = None
    success: float | None = None
    length: float | None = None
    dropped_stale: int = 0  # running total, trajectories
    dropped_groups: int = 0  # running total, groups
    drawn: int = 0  # this step: replacement groups producers published (dynamic sampling)


# TaskMetrics field -> tracker name; the CSV column is "<field>/<agent>", the tracker's
# "<name>/<agent>".
TASK_TRACKER_NAMES: Mapping[str, str] = {
    "groups": "batch/groups",
    "trajectories": "batch/trajectories",
    "reward_mean_received": "reward/mean",
    "reward_mean_trained": "reward/mean_trained",
    "success": "reward/success",
    "length": "response/length",
    "dropped_stale": "dropped/stale",
    "dropped_groups": "dropped/groups",
    "drawn": "batch/drawn",
}
assert tuple(TASK_TRACKER_NAMES) == tuple(TaskMetrics.__dataclass_fields__)


def task_columns(agents: tuple[str, ...] | list[str]) -> list[str]:
    """The per-task CSV columns of these agents, in order."""
    return [f"{name}/{agent}" for agent in agents for name in TASK_TRACKER_NAMES]


ROLLOUT = "rollout/"  # the prefix of the agents' own metrics, in the CSV and the trackers


@dataclass
class StepMetrics:
    step: int
    version: int
    reward_mean_received: float | None = None  # None: no ok trajectory arrived since the last step
    reward_mean_trained: float = 0.0
    reward_std: float = 0.0
    loss: float = 0.0
    kl: float = 0.0
    clip_frac: float = 0.0
    entropy: float = 0.0
    tokens: int = 0
    tokens_per_s: float = 0.0
    step_s: float = 0.0
    groups_used: int = 0
    dropped_stale: int = 0
    dropped_flat: int = 0
    staleness_max: int = 0
    staleness_mean: float = 0.0
    staleness_hist: dict[int, int] = field(default_factory=dict)
    model_tokens: int = 0
    rows: int = 0
    grad_norm: float = 0.0
    ratio_mean: float = 0.0
    wait_s: float = 0.0
    tis_weighted: int = 0
    prefix_mismatches: int = 0
    multi_turn_rows: int = 0
    failed_members: int = 0
    refused: int = 0
    validation_skipped: int = 0
    drawn: int = 0
    overlong: int = 0
    stale_masked: int = 0
    foreign_weights: int = 0
    stale_policy: str = "drop"  # the trainer's --stale-policy: no scalar form
    time: float = field(default_factory=time.time)
    tasks: dict[str, TaskMetrics] = field(default_factory=dict)  # per agent: not a column
    # the agents' own metrics (Trajectory.metrics), each the mean over the step's trained
    # trajectories that report it: columns ``rollout/<name>``
    rollout: dict[str, float] = field(default_factory=dict)

    def as_row(self) -> dict[str, object]:
        row = asdict(self)
        del row["tasks"], row["rollout"]
        row["staleness_hist"] = " ".join(f"{k}:{v}" for k, v in sorted(self.staleness_hist.items()))
        for agent, task in self.tasks.items():
            for name in TASK_TRACKER_NAMES:
                value = getattr(task, name)
                row[f"{name}/{agent}"] = "" if value is None else value
        for name, value in sorted(self.rollout.items()):
            row[f"{ROLLOUT}{name}"] = value
        if row["reward_mean_received"] is None:
            row["reward_mean_received"] = ""
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}

    def scalars(self) -> dict[str, float]:
        """The step's values under their tracker names (``TRACKER_NAMES``, then per task
        ``TASK_TRACKER_NAMES`` + ``/<agent>``; a task's empty value is left out)."""
        out = {
            name: float(getattr(self, column))
            for column, name in TRACKER_NAMES.items()
            if getattr(self, column) is not None
        }
        for agent, task in self.tasks.items():
            for column, name in TASK_TRACKER_NAMES.items():
                value = getattr(task, column)
                if value is not None:
                    out[f"{name}/{agent}"] = float(value)
        for name, value in self.rollout.items():
            out[f"{ROLLOUT}{name}"] = float(value)
        return out


FIELDS = tuple(f for f in StepMetrics.__dataclass_fields__ if f not in ("tasks", "rollout"))
assert FIELDS[: len(COLUMNS)] == COLUMNS, "the CSV's leading columns are a contract"

# CSV column -> tracker name. Groups as verl's: one panel per prefix in TensorBoard and W&B.
# Running totals (since the trainer started) are under dropped/ and trajectories/.
TRACKER_NAMES: Mapping[str, str] = {
    "reward_mean_received": "reward/mean",
    "reward_mean_trained": "reward/mean_trained",
    "reward_std": "reward/std",
    "loss": "actor/loss",
    "kl": "actor/kl",
    "clip_frac": "actor/clip_frac",
    "entropy": "actor/entropy",
    "grad_norm": "actor/grad_norm",
    "ratio_mean": "actor/ratio_mean",
    "version": "policy/version",
    "staleness_max": "staleness/max",
    "staleness_mean": "staleness/mean",
    "tokens": "perf/tokens",
    "model_tokens": "perf/model_tokens",
    "tokens_per_s": "perf/tokens_per_s",
    "step_s": "timing_s/step",
    "wait_s": "timing_s/wait",
    "groups_used": "batch/groups",
    "rows": "batch/rows",
    "prefix_mismatches": "batch/prefix_mismatches",
    "multi_turn_rows": "batch/multi_turn_rows",
    "dropped_stale": "dropped/stale",
    "dropped_flat": "dropped/flat",
    "tis_weighted": "trajectories/tis_weighted",
    "failed_members": "trajectories/failed",
    "refused": "trajectories/refused",
    "validation_skipped": "trajectories/validation_skipped",
    "drawn": "batch/drawn",
    "overlong": "trajectories/overlong",
    "stale_masked": "trajectories/stale_masked",
    "foreign_weights": "trajectories/foreign_weights",
}
assert set(TRACKER_NAMES) == set(FIELDS) - {"step", "staleness_hist", "stale_policy", "time"}, (
    "every StepMetrics field needs a tracker name (or a reason to have none)"
)


class MetricsSink:
    """CSV (when ``path`` is set), OpenTelemetry instruments and a Tracker; ``record`` never
    branches on whether anything listens: without a MeterProvider the instruments are no-ops,
    and without a tracker it holds a NullTracker."""

    def __init__(
        self,
        path: str | Path | None,
        *,
        attributes: dict | None = None,
        append=False,
        tracker: Tracker | None = None,
        tasks: tuple[str, ...] | list[str] = (),
    ):
        self.path = Path(path) if path else None
        self.attributes = dict(attributes or {})
        self.tracker = tracker or NullTracker()
        self._file = None
        self._writer = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fieldnames = [*FIELDS, *task_columns(tasks)]
            fresh = not (append and self.path.is_file() and self.path.stat().st_size > 0)
            if not fresh:
                fieldnames = _widen_header(self.path, fieldnames)
            self._file = self.path.open("w" if fresh else "a", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=fieldnames)
            if fresh:
                self._writer.writeheader()
                self._file.flush()
        meter = otel_metrics.get_meter("agentarium.trainer")
        self._gauges = {
            name: meter.create_gauge(f"agentarium.trainer.{name}", unit=unit, description=desc)
            for name, unit, desc in (
                ("reward_mean_received", "1", "mean reward of the ok trajectories received"),
                ("reward_mean_trained", "1", "mean reward of the step's trained trajectories"),
                ("reward_std", "1", "reward std of the step's trained trajectories"),
                ("loss", "1", "GRPO loss"),
                ("kl", "1", "mean k3 KL to the reference per model token"),
                ("clip_frac", "1", "fraction of model tokens whose ratio was clipped"),
                ("entropy", "nat", "mean policy entropy per model token"),
                ("tokens_per_s", "{token}/s", "tokens processed per second of update"),
                ("version", "1", "policy version the trainer publishes"),
                ("staleness_max", "{version}", "oldest token of the step, versions behind"),
            )
        }
        self._step_s = meter.create_histogram(
            "agentarium.trainer.step.duration", unit="s", description="time of one update"
        )
        self._staleness = meter.create_histogram(
            "agentarium.trainer.staleness", unit="{version}", description="trajectory staleness"
        )
        self._counters = {
            name: meter.create_counter(f"agentarium.trainer.{name}", unit=unit)
            for name, unit in (
                ("steps", "{step}"),
                ("tokens", "{token}"),
                ("groups_used", "{group}"),
                ("dropped_stale", "{trajectory}"),
                ("dropped_flat", "{group}"),
            )
        }
        self._last_totals = {"dropped_stale": 0, "dropped_flat": 0}

    def record(self, m: StepMetrics) -> None:
        if self._writer is not None:
            row = m.as_row()
            if any(name not in self._writer.fieldnames for name in row):
                self._widen(list(row))  # an agent metric seen for the first time
            self._writer.writerow(row)
            assert self._file is not None, (
                "the writer writes to _file; record() after close() is a bug"
            )
            self._file.flush()
        attrs = self.attributes
        for name, gauge in self._gauges.items():
            if getattr(m, name) is not None:
                gauge.set(float(getattr(m, name)), attrs)
        self._step_s.record(m.step_s, attrs)
        for stale, count in m.staleness_hist.items():
            for _ in range(count):
                self._staleness.record(stale, attrs)
        self._counters["steps"].add(1, attrs)
        self._counters["tokens"].add(m.tokens, attrs)
        self._counters["groups_used"].add(m.groups_used, attrs)
        for name in ("dropped_stale", "dropped_flat"):  # running totals -> counter deltas
            delta = getattr(m, name) - self._last_totals[name]
            if delta > 0:
                self._counters[name].add(delta, attrs)
            self._last_totals[name] = getattr(m, name)
        self.tracker.log(m.step, m.scalars())

    def _widen(self, names: list[str]) -> None:
        """Rewrite the CSV once under a header that has ``names`` too (rows kept)."""
        assert self._file is not None and self._writer is not None and self.path is not None
        self._file.close()
        header = _widen_header(self.path, [*self._writer.fieldnames, *names])
        self._file = self.path.open("a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=header)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tracker.close()


def _widen_header(path: Path, fieldnames: list[str]) -> list[str]:
    """The header to append under: the file's, rewritten once (rows kept, new cells empty)
    when this trainer writes columns it lacks (a resumed trainer with another agent set)."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        header = list(reader.fieldnames or [])
        if all(name in header for name in fieldnames):
            return header
        rows = list(reader)
    union = header + [name for name in fieldnames if name not in header]
    staged = path.with_name(path.name + ".tmp")
    with staged.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=union)
        writer.writeheader()
        writer.writerows(rows)
    staged.replace(path)
    return union


def read_metrics(path: str | Path) -> list[dict[str, str]]:
    """The CSV's rows, one per step (the last row wins when a resumed trainer repeated one)."""
    with Path(path).open(newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames and "step" not in reader.fieldnames:
            raise ValueError(
                f"{path} has no 'step' column: not a trainer's --metrics CSV "
                f"(columns: {', '.join(reader.fieldnames)})"
            )
        rows = {int(r["step"]): r for r in reader}
    return [rows[s] for s in sorted(rows)]


def plot_metrics(
    csv_path: str | Path, png_path: str | Path, *, column: str = "reward_mean_received"
) -> Path:
    """Write a PNG of ``column`` against step, with a moving mean once there are 40+ steps.
    When the CSV holds that column for two or more tasks (``<column>/<agent>``), one curve per
    task, in one figure (a task's empty steps are skipped)."""
    rows = read_metrics(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no rows to plot: run the trainer with --metrics first")
    per_task = [name for name in rows[0] if name.startswith(column + "/")]
    if column not in rows[0] and not per_task:
        raise ValueError(f"{csv_path} has no column {column!r}; columns: {', '.join(rows[0])}")
    curves = per_task if len(per_task) >= 2 else [column if column in rows[0] else per_task[0]]
    several = len(curves) > 1
    title = f"{column} per task vs step" if several else f"{column} vs step"
    with step_figure(png_path, title) as ax:
        _plot_curves(ax, rows, curves, several)
        ax.set_ylabel(column)
    return Path(png_path)


def _plot_curves(ax: Any, rows: list[dict[str, str]], curves: list[str], several: bool) -> None:
    """Each curve's steps, and its moving mean once there are 40+ of them."""
    for i, name in enumerate(curves):
        points = [(float(r["step"]), float(r[name])) for r in rows if r.get(name) not in ("", None)]
        xs, ys = [x for x, _ in points], [y for _, y in points]
        window = max(1, len(ys) // 20)
        if several:  # one colour per task: faint steps, the moving mean (when any) on top
            label, raw, dark = name.split("/", 1)[1], f"C{i}", f"C{i}"
            faint = {"alpha": 0.35} if window > 1 else {"label": label}
            ax.plot(xs, ys, color=raw, linewidth=1, **faint)
        else:
            label, raw, dark = name, "#9bbbd4", "#1f5f8b"
            ax.plot(xs, ys, color=raw, linewidth=1, label=label)
        if window > 1:
            windows = [ys[max(0, j - window + 1) : j + 1] for j in range(len(ys))]
            smooth = [sum(w) / len(w) for w in windows]
            text = label if several else f"{label} (mean of {window})"
            ax.plot(xs, smooth, color=dark, linewidth=2, label=text)


@contextlib.contextmanager
def step_figure(png_path: str | Path, title: str) -> Iterator[Any]:
    """A figure of something against the step, written to ``png_path`` (its folder made) once
    the block has drawn on the axes it is given: the step axis, a grid, a legend and the title
    added; no window is ever opened (headless trainers, CI)."""
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    import matplotlib  # here, not at the top: only a plot pays its import

    matplotlib.use("Agg", force=True)  # a file, never a window
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    try:
        yield ax
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(loc="best")
        fig.tight_layout()
        fig.savefig(png_path)
    finally:
        plt.close(fig)
