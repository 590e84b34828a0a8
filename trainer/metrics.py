"""Per-step training metrics: one CSV row per step, the same values as OpenTelemetry metrics
and as experiment-tracker scalars (trainer/trackers.py), and a PNG plot of reward against step.

Columns (in this order; the first ones are the stable contract):

    step, version, reward_mean, reward_std, loss, kl, clip_frac, entropy, tokens, tokens_per_s,
    step_s, groups_used, dropped_stale, dropped_flat, staleness_max, staleness_mean,
    staleness_hist, then extras (model_tokens, rows, grad_norm, ratio_mean, wait_s, tis_weighted,
    prefix_mismatches, failed_members, refused, validation_skipped, time).

``version`` is the policy version the step's data was judged against (the update it makes is
published as the next version). ``tokens`` counts every real token of the batch (prompts too:
what the forward pass processes), ``tokens_per_s`` divides it by ``step_s`` (batch building
and the update, not the wait for data). ``dropped_*``, ``tis_weighted``, ``failed_members``, ``refused`` and
``validation_skipped`` are running totals, since drops happen between steps. The staleness
columns cover every ok trajectory weighed for the step (trained or dropped as stale);
``staleness_hist`` reads ``0:96 1:24 3:8`` (versions behind: trajectories).

Trackers (TensorBoard, W&B, MLflow) get the same values under verl-style ``/``-grouped names,
identical in every tracker: ``TRACKER_NAMES`` maps each CSV column to its name
(``reward_mean`` -> ``reward/mean``). ``staleness_hist`` and ``time`` have no scalar form there
(``staleness/max`` and ``staleness/mean`` summarise the first; trackers stamp their own time).

A resumed trainer appends to the same CSV, so steps trained after the last checkpoint of a
killed trainer appear twice; ``read_metrics`` keeps the last row of each step.
"""

from __future__ import annotations

import csv
import math
import struct
import time
import zlib
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from opentelemetry import metrics as otel_metrics

from .trackers import NullTracker, Tracker

COLUMNS = (
    "step",
    "version",
    "reward_mean",
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
class StepMetrics:
    step: int
    version: int
    reward_mean: float = 0.0
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
    failed_members: int = 0
    refused: int = 0
    validation_skipped: int = 0
    time: float = field(default_factory=time.time)

    def as_row(self) -> dict[str, object]:
        row = asdict(self)
        row["staleness_hist"] = " ".join(f"{k}:{v}" for k, v in sorted(self.staleness_hist.items()))
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in row.items()}

    def scalars(self) -> dict[str, float]:
        """The step's values under their tracker names (``TRACKER_NAMES``)."""
        return {name: float(getattr(self, column)) for column, name in TRACKER_NAMES.items()}


FIELDS = tuple(StepMetrics.__dataclass_fields__)
assert FIELDS[: len(COLUMNS)] == COLUMNS, "the CSV's leading columns are a contract"

# CSV column -> tracker name. Groups as verl's: one panel per prefix in TensorBoard and W&B.
# Running totals (since the trainer started) are under dropped/ and trajectories/.
TRACKER_NAMES: Mapping[str, str] = {
    "reward_mean": "reward/mean",
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
    "dropped_stale": "dropped/stale",
    "dropped_flat": "dropped/flat",
    "tis_weighted": "trajectories/tis_weighted",
    "failed_members": "trajectories/failed",
    "refused": "trajectories/refused",
    "validation_skipped": "trajectories/validation_skipped",
}
assert set(TRACKER_NAMES) == set(FIELDS) - {"step", "staleness_hist", "time"}, (
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
    ):
        self.path = Path(path) if path else None
        self.attributes = dict(attributes or {})
        self.tracker = tracker or NullTracker()
        self._file = None
        self._writer = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fresh = not (append and self.path.is_file() and self.path.stat().st_size > 0)
            self._file = self.path.open("w" if fresh else "a", newline="")
            self._writer = csv.DictWriter(self._file, fieldnames=FIELDS)
            if fresh:
                self._writer.writeheader()
                self._file.flush()
        meter = otel_metrics.get_meter("agentarium.trainer")
        self._gauges = {
            name: meter.create_gauge(f"agentarium.trainer.{name}", unit=unit, description=desc)
            for name, unit, desc in (
                ("reward_mean", "1", "mean reward of the step's trajectories"),
                ("reward_std", "1", "reward std of the step's trajectories"),
                ("loss", "1", "GRPO loss"),
                ("kl", "1", "mean k3 KL to the reference per model token"),
                ("clip_frac", "1", "fraction of model tokens whose ratio was clipped"),
                ("entropy", "nat", "mean policy entropy per model token"),
                ("tokens_per_s", "{token}/s", "tokens processed per second of update"),
                ("version", "1", "policy version the trainer publishes"),
                ("staleness_max", "{version}", "oldest trajectory of the step, versions behind"),
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
            self._writer.writerow(m.as_row())
            assert self._file is not None, (
                "the writer writes to _file; record() after close() is a bug"
            )
            self._file.flush()
        attrs = self.attributes
        for name, gauge in self._gauges.items():
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

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.tracker.close()


def read_metrics(path: str | Path) -> list[dict[str, str]]:
    """The CSV's rows, one per step (the last row wins when a resumed trainer repeated one)."""
    with Path(path).open(newline="") as f:
        rows = {int(r["step"]): r for r in csv.DictReader(f)}
    return [rows[s] for s in sorted(rows)]


def plot_metrics(
    csv_path: str | Path, png_path: str | Path, *, column: str = "reward_mean"
) -> Path:
    """Write a PNG of ``column`` against step (matplotlib when installed, else a plain plot)."""
    rows = read_metrics(csv_path)
    if not rows:
        raise ValueError(f"{csv_path} has no rows to plot: run the trainer with --metrics first")
    if column not in rows[0]:
        raise ValueError(f"{csv_path} has no column {column!r}; columns: {', '.join(rows[0])}")
    xs = [float(r["step"]) for r in rows]
    ys = [float(r[column]) for r in rows]
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        import matplotlib
    except ImportError:
        _write_png(png_path, *_render(xs, ys))
        return png_path
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=100)
    ax.plot(xs, ys, color="#9bbbd4", linewidth=1, label=column)
    window = max(1, len(ys) // 20)
    if window > 1:
        windows = [ys[max(0, i - window + 1) : i + 1] for i in range(len(ys))]
        smooth = [sum(w) / len(w) for w in windows]
        ax.plot(xs, smooth, color="#1f5f8b", linewidth=2, label=f"{column} (mean of {window})")
    ax.set_xlabel("step")
    ax.set_ylabel(column)
    ax.set_title(f"{column} vs step")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


# ---- a dependency-free PNG line plot (no matplotlib) --------------------------------------
_W, _H, _MARGIN = 640, 360, 40
_FONT = {  # 3x5 glyphs, one 3-bit row each
    "0": (7, 5, 5, 5, 7),
    "1": (2, 6, 2, 2, 7),
    "2": (7, 1, 7, 4, 7),
    "3": (7, 1, 7, 1, 7),
    "4": (5, 5, 7, 1, 1),
    "5": (7, 4, 7, 1, 7),
    "6": (7, 4, 7, 5, 7),
    "7": (7, 1, 1, 1, 1),
    "8": (7, 5, 7, 5, 7),
    "9": (7, 5, 7, 1, 7),
    ".": (0, 0, 0, 0, 2),
    "-": (0, 0, 7, 0, 0),
}


def _render(xs: list[float], ys: list[float]) -> tuple[int, int, bytearray]:
    pixels = bytearray(b"\xff" * (_W * _H * 3))

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < _W and 0 <= y < _H:
            i = (y * _W + x) * 3
            pixels[i : i + 3] = bytes(rgb)

    def line(x0, y0, x1, y1, rgb):
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for s in range(steps + 1):
            put(round(x0 + (x1 - x0) * s / steps), round(y0 + (y1 - y0) * s / steps), rgb)

    def text(x: int, y: int, s: str) -> None:
        for ch in s:
            for row, bits in enumerate(_FONT.get(ch, (0,) * 5)):
                for col in range(3):
                    if bits >> (2 - col) & 1:
                        for dx in range(2):
                            for dy in range(2):
                                put(x + 2 * col + dx, y + 2 * row + dy, (0, 0, 0))
            x += 8

    x_lo, x_hi = min(xs), max(xs)
    y_lo, y_hi = min(ys), max(ys)
    if math.isclose(x_lo, x_hi):
        x_hi = x_lo + 1
    if math.isclose(y_lo, y_hi):
        y_lo, y_hi = y_lo - 0.5, y_hi + 0.5
    left, right, top, bottom = _MARGIN + 20, _W - _MARGIN, _MARGIN, _H - _MARGIN

    def px(x: float, y: float) -> tuple[int, int]:
        return (
            round(left + (x - x_lo) / (x_hi - x_lo) * (right - left)),
            round(bottom - (y - y_lo) / (y_hi - y_lo) * (bottom - top)),
        )

    line(left, bottom, right, bottom, (0, 0, 0))
    line(left, top, left, bottom, (0, 0, 0))
    text(2, top - 4, f"{y_hi:.2f}")
    text(2, bottom - 4, f"{y_lo:.2f}")
    text(left, bottom + 8, f"{x_lo:.0f}")
    text(right - 40, bottom + 8, f"{x_hi:.0f}")
    points = [px(x, y) for x, y in zip(xs, ys, strict=True)]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        line(x0, y0, x1, y1, (31, 95, 139))
    if len(points) == 1:
        put(*points[0], (31, 95, 139))
    return _W, _H, pixels


def _write_png(path: Path, width: int, height: int, rgb: bytearray) -> None:
    def chunk(kind: bytes, data: bytes) -> bytes:
        body = kind + data
        return struct.pack(">I", len(data)) + body + struct.pack(">I", zlib.crc32(body))

    stride = width * 3
    raw = b"".join(b"\x00" + bytes(rgb[y * stride : (y + 1) * stride]) for y in range(height))
    png = b"\x89PNG\r\n\x1a\n"
    png += chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
    png += chunk(b"IDAT", zlib.compress(raw, 9))
    png += chunk(b"IEND", b"")
    path.write_bytes(png)
