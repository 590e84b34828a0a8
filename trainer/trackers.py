"""Experiment trackers: each step's scalars sent to TensorBoard, Weights & Biases and MLflow,
under the same names in all three (``StepMetrics.scalars()``, trainer/metrics.py).

One interface, ``Tracker``: ``log(step, metrics)`` and ``close()``. ``open_trackers`` returns one
object that fans out to every selected backend, or a ``NullTracker`` when none is selected, so
the loop never asks whether logging is on. A backend's package is imported only when it is
selected, and ``missing_packages`` lets the config refuse a selection before any work, naming
the pip package. ``csv`` (the default) is the metrics CSV itself (trainer/metrics.py), whose
columns are a contract of their own; it has no tracker object here.

Where each backend writes (``directory`` = ``TrainerConfig.tracker_path()``):

    tensorboard  <directory>/tensorboard/<run>/<agent>/events.out.tfevents.*
    wandb        <directory>/wandb/offline-run-*/run-<id>.wandb: offline, no account or key,
                 unless WANDB_MODE says otherwise; `wandb sync` uploads it later
    mlflow       sqlite:///<directory>/mlflow.db, or MLFLOW_TRACKING_URI when set; experiment
                 MLFLOW_EXPERIMENT_NAME, else "agentarium"

A resumed trainer continues the same W&B run (its id derives from run and agent) and the same
MLflow run (found by its tags), and TensorBoard drops what a killed predecessor logged after
the checkpoint being resumed, so the replayed steps are not drawn twice.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import structlog

from .errors import TrackerError, TrainerConfigError

if TYPE_CHECKING:
    from .config import TrainerConfig

log = structlog.get_logger("agentarium.trainer")

TRACKERS = ("csv", "tensorboard", "wandb", "mlflow")

# Python module -> pip package, per backend. MLflow's own file store refuses to open unless
# MLFLOW_ALLOW_FILE_STORE is set (MLflow 3.17), so the local default is its SQLite store, which needs
# sqlalchemy and alembic; mlflow-skinny leaves both out.
_PACKAGES: dict[str, tuple[tuple[str, str], ...]] = {
    "tensorboard": (("tensorboard", "tensorboard"),),
    "wandb": (("wandb", "wandb"),),
    "mlflow": (("mlflow", "mlflow-skinny"), ("sqlalchemy", "sqlalchemy"), ("alembic", "alembic")),
}
_MLFLOW_DB_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")


@runtime_checkable
class Tracker(Protocol):
    def log(self, step: int, metrics: Mapping[str, float]) -> None: ...

    def close(self) -> None: ...


class NullTracker:
    """Logs nothing: what the trainer holds when no tracker is selected."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass(frozen=True, kw_only=True)
class TrackerRun:
    """What every backend needs to name and place one trainer's run."""

    run: str
    agent: str
    directory: Path
    config: Mapping[str, Any] = field(default_factory=dict)  # hyperparameters, logged once
    resume: bool = False
    start_step: int = 0  # the step a resumed trainer continues from

    @property
    def name(self) -> str:
        return f"{self.run}/{self.agent}"


def parse_report_to(value: str | Iterable[str]) -> tuple[str, ...]:
    """``"csv,tensorboard"`` or a list of names (each may itself be comma-separated, as a
    flag's value arrives) -> a tuple without repeats; ``none`` -> ()."""
    parts = [value] if isinstance(value, str) else list(value)
    items = [piece for part in parts for piece in str(part).split(",")]
    names: list[str] = []
    for item in (str(i).strip().lower() for i in items):
        if item and item != "none" and item not in names:
            names.append(item)
    unknown = [n for n in names if n not in TRACKERS]
    if unknown:
        raise TrainerConfigError(
            f"--report-to {','.join(unknown)}: unknown tracker; choose any of "
            f"{','.join(TRACKERS)} (comma-separated), or none"
        )
    return tuple(names)


def missing_packages(names: Iterable[str]) -> list[str]:
    """The pip packages the selected trackers need and this environment lacks."""
    missing = []
    for name in names:
        for module, package in _PACKAGES.get(name, ()):
            if module in ("sqlalchemy", "alembic") and not _mlflow_uses_a_database():
                continue
            if importlib.util.find_spec(module) is None and package not in missing:
                missing.append(package)
    return missing


def check_installed(names: Iterable[str]) -> None:
    names = list(names)
    missing = missing_packages(names)
    if missing:
        raise TrainerConfigError(
            f"--report-to {','.join(names)} needs {' '.join(missing)}: "
            f"pip install {' '.join(missing)} (or pip install 'agentarium[trackers]')"
        )


def open_trackers(config: TrainerConfig, *, resume: bool = False, start_step: int = 0) -> Tracker:
    """One Tracker for every backend in ``config.report_to`` (a NullTracker for none)."""
    run = TrackerRun(
        run=config.run,
        agent=config.label,  # the agent, a+b for several, all for '*'
        directory=config.tracker_path(),
        config=config.to_log(),
        resume=resume,
        start_step=start_step,
    )
    return open_backends(config.report_to, run)


def open_backends(names: str | Iterable[str], run: TrackerRun) -> Tracker:
    """One Tracker for the named backends (``csv`` is the metrics CSV: nothing to open here)."""
    names = [n for n in parse_report_to(names) if n != "csv"]
    check_installed(names)
    opened: list[tuple[str, Tracker]] = []
    try:
        for name in names:
            opened.append((name, _OPENERS[name](run)))
    except BaseException:
        FanOut(opened).close()  # what opened before the failure must not leak a run
        raise
    if not opened:
        return NullTracker()
    log.info("trackers open", trackers=names, directory=str(run.directory), run=run.name)
    return FanOut(opened)


class FanOut:
    """Every selected backend. A backend that fails to log is reported and skipped for that
    step: a chart that misses a point must not stop a training run."""

    def __init__(self, trackers: list[tuple[str, Tracker]]) -> None:
        self.trackers = trackers

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, tracker in self.trackers:
            try:
                tracker.log(step, metrics)
            except Exception as exc:
                log.warning("tracker failed to log a step", tracker=name, step=step, error=str(exc))

    def close(self) -> None:
        for name, tracker in self.trackers:
            try:
                tracker.close()
            except Exception as exc:
                log.warning("tracker failed to close", tracker=name, error=str(exc))


class TensorBoardTracker:
    def __init__(self, run: TrackerRun) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.directory = run.directory / "tensorboard" / run.run / run.agent
        # On resume, events from the killed trainer's steps after the checkpoint are purged:
        # the replay logs those steps again.
        purge = run.start_step + 1 if run.resume else None
        self._writer = SummaryWriter(str(self.directory), purge_step=purge)
        if not run.resume:
            text = json.dumps(dict(run.config), indent=1, default=str)
            self._writer.add_text("config", "    " + text.replace("\n", "\n    "), 0)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(name, value, step)
        self._writer.flush()  # a step takes seconds: show it now, not after flush_secs

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    def __init__(self, run: TrackerRun) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE") or "offline"
        run.directory.mkdir(parents=True, exist_ok=True)  # wandb falls back to /tmp without it
        try:
            self._run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or "agentarium",
                name=run.name,
                group=run.run,
                job_type="train",
                id=wandb_run_id(run.run, run.agent),
                resume="allow",
                dir=str(run.directory),
                mode=mode,  # type: ignore[arg-type]  # WANDB_MODE is checked by wandb
                config=dict(run.config),
                # W&B's banner and console capture would break the trainer's JSON-lines stderr
                settings=wandb.Settings(console="off", silent=True),
            )
        except Exception as exc:
            raise TrackerError(
                f"wandb could not start a run in mode {mode!r}: {str(exc).rstrip('.')}. Offline "
                "mode needs no account: unset WANDB_MODE (or set it to offline); online needs "
                "WANDB_API_KEY"
            ) from exc
        self.directory = Path(self._run.dir).parent
        log.info(
            "wandb run",
            mode=mode,
            directory=str(self.directory),
            sync=f"wandb sync {self.directory}",
        )

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self._run.log(dict(metrics), step=step)

    def close(self) -> None:
        self._run.finish()


def wandb_run_id(run: str, agent: str) -> str:
    """The same id for the same (run, agent), so a resumed trainer continues its W&B run."""
    return hashlib.sha256(f"{run}\0{agent}".encode()).hexdigest()[:16]


class MlflowTracker:
    def __init__(self, run: TrackerRun) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_tracking_uri(run.directory)
        if self.uri.startswith("sqlite:"):
            run.directory.mkdir(parents=True, exist_ok=True)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "agentarium"
        try:
            self._client = client = MlflowClient(tracking_uri=self.uri)
            experiment_id = _experiment_id(client, experiment, MlflowException)
            tags = {"agentarium.run": run.run, "agentarium.agent": run.agent}
            found = (
                client.search_runs(
                    [experiment_id],
                    " and ".join(f"tags.`{k}` = '{v}'" for k, v in tags.items()),
                    order_by=["attributes.start_time DESC"],
                    max_results=1,
                )
                if run.resume
                else []
            )
            if found:
                self.run_id = found[0].info.run_id
                client.update_run(self.run_id, status="RUNNING")
            else:
                self.run_id = client.create_run(
                    experiment_id, run_name=run.name, tags=tags
                ).info.run_id
                params = [Param(k, str(v)[:6000]) for k, v in run.config.items()]
                client.log_batch(self.run_id, params=params)
        except MlflowException as exc:
            raise TrackerError(
                f"mlflow at {self.uri} refused the run: {exc.message}. Check "
                "MLFLOW_TRACKING_URI, or unset it to log to a local SQLite file"
            ) from exc
        self._metric = Metric
        log.info("mlflow run", uri=self.uri, experiment=experiment, run_id=self.run_id)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        now = int(time.time() * 1000)
        batch = [self._metric(k, float(v), now, step) for k, v in metrics.items()]
        self._client.log_batch(self.run_id, metrics=batch)

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


def mlflow_tracking_uri(directory: Path) -> str:
    """MLFLOW_TRACKING_URI when set, else a SQLite file in the tracker directory."""
    return os.environ.get("MLFLOW_TRACKING_URI") or (
        f"sqlite:///{(directory / 'mlflow.db').resolve()}"
    )


def _mlflow_uses_a_database() -> bool:
    uri = os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:"
    return uri.split(":", 1)[0].split("+", 1)[0] in _MLFLOW_DB_SCHEMES


def _experiment_id(client: Any, name: str, mlflow_exception: type[Exception]) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    try:
        return client.create_experiment(name)
    except mlflow_exception:  # another trainer (another agent) created it just now
        return client.get_experiment_by_name(name).experiment_id


_OPENERS: dict[str, Any] = {
    "tensorboard": TensorBoardTracker,
    "wandb": WandbTracker,
    "mlflow": MlflowTracker,
}
