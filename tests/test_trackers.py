"""Experiment trackers: a trainer on a real nats-server reports each step to TensorBoard, W&B
(offline, no key) and MLflow (a local SQLite file), and every tracker is read back with its own
reader: the same names, the same values as the metrics CSV. Resuming continues the same runs;
a missing package or an unknown tracker is refused with what to install or type."""

from __future__ import annotations

import argparse
import importlib.util
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainlib import one_call_group, publish, tiny_config

from agentarium.commands.trainer_cmd import add_trainer_arguments, config_from_args
from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.errors import TrainerConfigError
from agentarium.trainer.loop import Trainer
from agentarium.trainer.metrics import TASK_TRACKER_NAMES, TRACKER_NAMES, read_metrics
from agentarium.trainer.trackers import FanOut, TrackerRun, open_backends, wandb_run_id

torch.set_num_threads(1)
RUN, AGENT = "tracked", "toy"
# the step's names, then each task's (one agent here) under "<name>/<agent>"
NAMES = set(TRACKER_NAMES.values()) | {f"{n}/toy" for n in TASK_TRACKER_NAMES.values()}


async def publish_groups(js, topology, groups: int) -> None:
    """Groups of 4 one-call trajectories; member i of group g scores 1 when i == g % 4."""
    for g in range(groups):
        group = one_call_group(
            g,
            run=RUN,
            agent=AGENT,
            job_id=lambda g, i: f"j{g}-{i}",
            group_id=f"g{g}",
            reward=lambda g, i: float(i == g % 4),
        )
        await publish(js, topology, group)


@pytest.fixture
def tracker_env(monkeypatch, tmp_path):
    """No W&B account, key or mode, no MLflow server: the defaults a fresh machine has."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_PROJECT", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))


def tensorboard_scalars(directory: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(directory), size_guidance={"scalars": 0})
    events.Reload()
    return {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }


def mlflow_scalars(uri: str) -> tuple[list[str], dict[str, list[tuple[int, float]]]]:
    """(run names, metric histories of the newest run)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name("agentarium")
    runs = client.search_runs([experiment.experiment_id])
    run = runs[0]
    history = {
        key: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]
        for key in run.data.metrics
    }
    return [r.info.run_name for r in runs], history


def wandb_history(run_file: Path) -> list[dict[str, float]]:
    """The history rows of an offline run's ``.wandb`` file. wandb ships no Python reader for
    it (its Go core reads it), so this reads the record log it writes: a 7-byte header
    (``:W&B``, magic, version), then 32 KiB blocks of records, each a 7-byte header (crc,
    length, type: 1 full, 2 first, 3 middle, 4 last) and a piece of a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    data = run_file.read_bytes()
    assert data[:4] == b":W&B", f"{run_file} is not a W&B run file"
    rows, pos, pending = [], 7, b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a record header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if kind == 0:
            break
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            if record.WhichOneof("record_type") == "history":
                items = record.history.item
                rows.append({i.key or "/".join(i.nested_key): float(i.value_json) for i in items})
    return rows


def config(tmp_path, **overrides) -> TrainerConfig:
    values = dict(
        run=RUN,
        agent=AGENT,
        metrics_path=str(tmp_path / "run" / "metrics.csv"),
        report_to="csv,tensorboard,wandb,mlflow",
    )
    return tiny_config(**{**values, **overrides})


async def test_every_tracker_reads_back_the_csv_values_under_the_same_names(
    js, topology, tmp_path, tracker_env
):
    await publish_groups(js, topology, 4)
    cfg = config(tmp_path)
    assert cfg.report_to == ("csv", "tensorboard", "wandb", "mlflow")
    assert cfg.tracker_path() == tmp_path / "run"  # beside the metrics CSV by default
    summary = await Trainer(cfg, js, topology=topology).run(max_steps=2)
    assert summary.steps == 2

    rows = read_metrics(tmp_path / "run" / "metrics.csv")
    expected = {
        TRACKER_NAMES[column]: [(int(r["step"]), float(r[column])) for r in rows]
        for column in ("reward_mean_trained", "loss", "tokens", "version")
    }
    expected[f"reward/success/{AGENT}"] = [
        (int(r["step"]), float(r[f"success/{AGENT}"])) for r in rows
    ]

    tb = tensorboard_scalars(tmp_path / "run" / "tensorboard" / RUN / AGENT)
    assert set(tb) == NAMES
    for name, points in expected.items():
        assert [(s, pytest.approx(v, abs=1e-6)) for s, v in points] == tb[name], name

    names, ml = mlflow_scalars(f"sqlite:///{tmp_path / 'run' / 'mlflow.db'}")
    assert names == [f"{RUN}/{AGENT}"] and set(ml) == NAMES
    for name, points in expected.items():
        assert [(s, pytest.approx(v, abs=1e-6)) for s, v in points] == ml[name], name

    (run_file,) = (tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")
    assert run_file.name == f"run-{wandb_run_id(RUN, AGENT)}.wandb"
    history = wandb_history(run_file)
    assert [int(h["_step"]) for h in history] == [1, 2]
    # the policy's reward (received) is logged for the steps that received trajectories: all
    # 16 arrived before the first step
    received = {"reward/mean", f"reward/mean/{AGENT}"}
    assert NAMES <= set(history[0]) and NAMES - received <= set(history[1])
    for name, points in expected.items():
        assert [(int(h["_step"]), h[name]) for h in history] == [
            (s, pytest.approx(v, abs=1e-6)) for s, v in points
        ], name


def test_a_resumed_trainer_continues_its_runs_without_drawing_replayed_steps_twice(
    tmp_path, tracker_env
):
    def run_steps(steps, *, resume, start_step=0):
        run = TrackerRun(
            run=RUN,
            agent=AGENT,
            directory=tmp_path,
            config={"lr": 0.001},
            resume=resume,
            start_step=start_step,
        )
        tracker = open_backends(("tensorboard", "mlflow"), run)
        for step in steps:
            tracker.log(step, {"reward/mean": step / 10})
        tracker.close()

    run_steps([1, 2, 3], resume=False)  # killed after step 3; its last checkpoint was step 2
    run_steps([3, 4], resume=True, start_step=2)
    tb = tensorboard_scalars(tmp_path / "tensorboard" / RUN / AGENT)
    assert [s for s, _ in tb["reward/mean"]] == [1, 2, 3, 4]
    names, ml = mlflow_scalars(f"sqlite:///{tmp_path / 'mlflow.db'}")
    assert names == [f"{RUN}/{AGENT}"]  # one run, continued
    assert sorted({s for s, _ in ml["reward/mean"]}) == [1, 2, 3, 4]


def test_mlflow_tracking_uri_overrides_the_local_file(tmp_path, tracker_env, monkeypatch):
    uri = f"sqlite:///{tmp_path / 'elsewhere.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    run = TrackerRun(run=RUN, agent=AGENT, directory=tmp_path / "run")
    tracker = open_backends(("mlflow",), run)
    tracker.log(1, {"reward/mean": 0.5})
    tracker.close()
    assert not (tmp_path / "run" / "mlflow.db").exists()
    assert mlflow_scalars(uri)[1] == {"reward/mean": [(1, 0.5)]}


def test_a_tracker_that_fails_to_log_does_not_stop_the_others():
    class Broken:
        def log(self, step, metrics):
            raise OSError("disk full")

        def close(self):
            raise OSError("disk full")

    class Kept:
        def __init__(self):
            self.steps, self.closed = [], False

        def log(self, step, metrics):
            self.steps.append(step)

        def close(self):
            self.closed = True

    kept = Kept()
    fan = FanOut([("broken", Broken()), ("kept", kept)])
    fan.log(1, {"reward/mean": 1.0})
    fan.close()
    assert kept.steps == [1] and kept.closed


def test_a_missing_package_is_named_with_the_pip_command(tmp_path, monkeypatch, tracker_env):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    with pytest.raises(TrainerConfigError, match=r"pip install wandb .*agentarium\[trackers\]"):
        config(tmp_path, report_to="csv,wandb")
    config(tmp_path, report_to="csv,tensorboard")  # the others still work


def test_report_to_flag(tmp_path):
    parser = argparse.ArgumentParser()
    add_trainer_arguments(parser)
    base = ["--run", "r", "--agent", "a", "--model", str(ensure_tiny_model())]
    metrics = ["--metrics", str(tmp_path / "m.csv")]

    def parse(*flags: str) -> TrainerConfig:
        return config_from_args(parser.parse_args([*base, *flags]))

    assert parse().report_to == ("csv",)  # the default, written only with --metrics
    cfg = parse(*metrics, "--report-to", "tensorboard, csv,tensorboard")
    assert cfg.report_to == ("tensorboard", "csv") and cfg.tracker_path() == tmp_path
    assert parse("--report-to", "none").report_to == ()
    assert parse("--report-to", "mlflow", "--tracker-dir", "x").tracker_path() == Path("x")
    assert parse("--report-to", "mlflow").tracker_path() == Path("runs/r")
    with pytest.raises(TrainerConfigError, match="unknown tracker; choose any of csv,tensorboard"):
        parse("--report-to", "csv,neptune")
    with pytest.raises(TrainerConfigError, match="pass --metrics FILE"):
        parse("--report-to", "csv,wandb")


def test_unselected_trackers_are_never_imported(tmp_path):
    code = (
        "import sys; from pathlib import Path;"
        "from agentarium.trainer.trackers import NullTracker, TrackerRun, open_backends;"
        "run = TrackerRun(run='r', agent='a', directory=Path(sys.argv[1]));"
        "assert isinstance(open_backends(('csv',), run), NullTracker);"
        "print(sorted(m for m in ('tensorboard', 'wandb', 'mlflow') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["[]"]
