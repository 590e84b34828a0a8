"""LiveView: what the dashboard knows of the run, refreshed from the broker.

Each ``refresh`` reads, over NATS only (the dashboard runs anywhere):

- ``broker.collect_status``: per agent waiting / in flight / dead, live workers with their
  rollouts/s, trajectories per run, each run's policy version (the numbers ``broker status``
  prints; with ``runs``, those runs counted exactly, as ``broker status --run``);
- the METRICS stream's new rows: the trainer's step metrics, per run;
- the newest trajectories (at most ``sample`` per refresh): the latest-trajectories list and
  the reward per agent over time, the mean over rollouts finished in each ``reward_window_s``;
- the newest dead letters, reduced to capped previews (``summaries.py``);
- the engines KV: the weight version each engine serves.

Streams are read from where the last refresh stopped (stream sequences), so a refresh costs
what arrived since, not the run's history. A missing stream or bucket (a broker provisioned by
an older release) becomes a note saying what to run, and the rest still shows.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from typing import Any

import nats.js.errors
import structlog
from nats.js import JetStreamContext

from agentarium.broker import StreamMetrics, Topology, collect_status, read_tail
from agentarium.inference import engine_versions
from agentarium.schemas import DeadLetter, SchemaError, Trajectory, decode, loads

from .config import DashboardConfig
from .summaries import dead_letter_row, trajectory_row, undecodable_dead_letter_row

log = structlog.get_logger("agentarium.dashboard")

# Per trainer step, what the charts and the runs table use (the whole row stays on the wire).
STEP_FIELDS = (
    "step",
    "version",
    "reward_mean_received",
    "reward_mean_trained",
    "reward_std",
    "loss",
    "tokens_per_s",
    "dropped_stale",
    "dropped_flat",
    "staleness_mean",
    "staleness_max",
    "time",
)
QUEUE_FIELDS = ("waiting", "in_flight", "rollouts_per_s", "dead_lettered")


class LiveView:
    def __init__(self, js: JetStreamContext, topology: Topology, config: DashboardConfig) -> None:
        self.js = js
        self.stream_metrics: StreamMetrics | None = None  # set when --metrics-port serves
        self.topology = topology
        self.config = config
        self.refreshes = 0
        self._seq = {"metrics": 0, "trajectories": 0, "dead": 0}
        self._steps: dict[str, dict[int, dict[str, Any]]] = {}
        self._last_row: dict[str, dict[str, Any]] = {}
        self._rewards: dict[str, dict[float, list[float]]] = {}
        self._latest: deque[dict[str, Any]] = deque(maxlen=config.trajectories)
        self._dead: deque[dict[str, Any]] = deque(maxlen=config.dead_letters)
        self._queues: deque[tuple[float, dict[str, dict[str, float]]]] = deque(
            maxlen=config.history
        )
        self._state: dict[str, Any] = self._empty()
        self._lock = asyncio.Lock()  # one refresh at a time: each moves the stream cursors

    def __repr__(self) -> str:
        return f"<LiveView prefix={self.topology.prefix} refreshes={self.refreshes}>"

    def snapshot(self) -> dict[str, Any]:
        """The latest state, as the page's JSON endpoint serves it."""
        return self._state

    def failed(self, error: str) -> None:
        """A refresh could not reach the broker: keep the last numbers, say why."""
        self._state = {**self._state, "error": error}

    async def refresh(self) -> dict[str, Any]:
        async with self._lock:
            return await self._refresh()

    async def _refresh(self) -> dict[str, Any]:
        started = time.monotonic()
        notes: list[str] = []
        status = await collect_status(self.js, self.topology, runs=self.config.runs)
        if self.stream_metrics is not None:
            self.stream_metrics.update(status)  # the Prometheus queue gauges, read once
        notes.extend(status.notes)
        await self._read_metrics(notes)
        await self._read_trajectories(notes)
        await self._read_dead_letters(notes)
        engines = await self._engines(notes)
        now = time.time()
        self._queues.append(
            (
                now,
                {a.agent: {f: float(getattr(a, f)) for f in QUEUE_FIELDS} for a in status.agents},
            )
        )
        self.refreshes += 1
        self._state = {
            "updated_at": now,
            "refresh_s": round(time.monotonic() - started, 3),
            "poll_ms": int(self.config.refresh_s * 1000),
            "prefix": self.topology.prefix,
            "error": None,
            "notes": notes,
            "agents": [vars(a) for a in status.agents],
            "workers": [_worker(w) for w in status.workers],
            "runs": self._runs(status.trajectories, status.policy),
            "queues": self._queue_series(),
            "metrics": self._metric_series(),
            "reward": self._reward_series(),
            "engines": engines,
            "trajectories": list(reversed(self._latest)),
            "dead_letters": list(reversed(self._dead)),
        }
        return self._state

    # ---- sources --------------------------------------------------------------------------
    async def _tail(self, key: str, stream: str, last: int, notes: list[str]):
        try:
            tail = await read_tail(self.js, stream, last=last, after_seq=self._seq[key])
        except nats.js.errors.NotFoundError:
            notes.append(f"stream {stream} does not exist: run `agentarium broker init`")
            return []
        self._seq[key] = tail.last_seq
        return tail.messages

    async def _read_metrics(self, notes: list[str]) -> None:
        for msg in await self._tail(
            "metrics", self.topology.metrics_stream, self.config.steps, notes
        ):
            try:
                row = loads(msg.data, (msg.headers or {}).get("Content-Type"))
                run, step = str(row["run"]), int(row["step"])
            except (SchemaError, KeyError, TypeError, ValueError):
                log.warning("unreadable metrics row skipped", subject=msg.subject)
                continue
            row = {k: _finite(v) for k, v in row.items()}
            steps = self._steps.setdefault(run, {})
            steps[step] = {f: row.get(f) for f in STEP_FIELDS}  # a resumed trainer's repeat wins
            if len(steps) > self.config.steps:
                for old in sorted(steps)[: len(steps) - self.config.steps]:
                    del steps[old]
            if step >= int(self._last_row.get(run, {}).get("step", -1)):
                self._last_row[run] = row

    async def _read_trajectories(self, notes: list[str]) -> None:
        for msg in await self._tail(
            "trajectories", self.topology.trajectories_stream, self.config.sample, notes
        ):
            seq = msg.metadata.sequence.stream
            try:
                t = decode(Trajectory, msg.data, (msg.headers or {}).get("Content-Type"))
            except SchemaError:
                continue  # `trajectories show` reports these; the view only counts what reads
            self._latest.append(trajectory_row(t, seq=seq, trace_url=self.config.trace_url))
            if t.status == "ok" and t.reward is not None and t.finished_at > 0:
                w = self.config.reward_window_s
                window = math.floor(t.finished_at / w) * w
                windows = self._rewards.setdefault(t.agent, {})
                total = windows.setdefault(window, [0.0, 0.0])
                total[0] += t.reward
                total[1] += 1
                if len(windows) > self.config.history:
                    del windows[min(windows)]

    async def _read_dead_letters(self, notes: list[str]) -> None:
        limit = self.config.preview_chars
        for msg in await self._tail(
            "dead", self.topology.dead_stream, self.config.dead_letters, notes
        ):
            seq = msg.metadata.sequence.stream
            agent = msg.subject.rsplit(".", 1)[-1]
            try:
                letter = decode(DeadLetter, msg.data, (msg.headers or {}).get("Content-Type"))
            except SchemaError as exc:
                self._dead.append(
                    undecodable_dead_letter_row(exc, agent=agent, seq=seq, limit=limit)
                )
                continue
            self._dead.append(dead_letter_row(letter, agent=agent, seq=seq, limit=limit))

    async def _engines(self, notes: list[str]) -> list[dict[str, Any]]:
        try:
            return await engine_versions(self.js, self.topology)
        except nats.js.errors.NotFoundError:
            notes.append(
                f"bucket {self.topology.engines_bucket} does not exist: run `agentarium broker init`"
            )
            return []

    # ---- the page's shapes ----------------------------------------------------------------
    def _runs(self, trajectories: dict[str, int], policy: dict[str, Any]) -> list[dict[str, Any]]:
        out = []
        for run in sorted(set(trajectories) | set(policy) | set(self._last_row)):
            row = self._last_row.get(run, {})
            out.append(
                {
                    "run": run,
                    "trajectories": trajectories.get(run, 0),
                    "policy_version": policy.get(run, {}).get("version"),
                    "agent": row.get("agent"),
                    **{f"trainer_{f}": row.get(f) for f in STEP_FIELDS},
                }
            )
        return out

    def _queue_series(self) -> dict[str, Any]:
        agents = sorted({a for _, row in self._queues for a in row})
        return {
            "t": [t for t, _ in self._queues],
            "agents": {
                a: {f: [row.get(a, {}).get(f) for _, row in self._queues] for f in QUEUE_FIELDS}
                for a in agents
            },
        }

    def _metric_series(self) -> dict[str, dict[str, list[Any]]]:
        return {
            run: {f: [steps[s][f] for s in sorted(steps)] for f in STEP_FIELDS}
            for run, steps in sorted(self._steps.items())
        }

    def _reward_series(self) -> dict[str, dict[str, list[Any]]]:
        out: dict[str, dict[str, list[Any]]] = {}
        for agent, windows in sorted(self._rewards.items()):
            keys = sorted(windows)
            out[agent] = {
                "t": keys,
                "mean": [round(windows[k][0] / windows[k][1], 6) for k in keys],
                "n": [int(windows[k][1]) for k in keys],
            }
        return out

    def _empty(self) -> dict[str, Any]:
        return {
            "updated_at": None,
            "refresh_s": 0.0,
            "poll_ms": int(self.config.refresh_s * 1000),
            "prefix": self.topology.prefix,
            "error": "not read yet",
            "notes": [],
            "agents": [],
            "workers": [],
            "runs": [],
            "queues": {"t": [], "agents": {}},
            "metrics": {},
            "reward": {},
            "engines": [],
            "trajectories": [],
            "dead_letters": [],
        }


def _finite(value: Any) -> Any:
    """JSON has no NaN or infinity: a browser's JSON.parse refuses the whole snapshot."""
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _worker(info: dict[str, Any]) -> dict[str, Any]:
    keys = (
        "worker_id",
        "agent",
        "host",
        "concurrency",
        "in_flight",
        "completed",
        "ok",
        "errors",
        "dead_lettered",
        "rollouts_per_s",
        "updated_at",
    )
    return {k: info.get(k) for k in keys}
