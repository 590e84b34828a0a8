"""The RL loop learns through the real pipeline: broker, engine, consumer, trainer, syncer.

Runs ``agentarium demo`` itself on a micro-task (every prompt asks for the digit 7, so no
conditioning is needed) with fixed task and trainer seeds, and reads the trainer's
metrics: with a learning rate the reward rises; with learning rate 0 it does not. The
control run trains against an engine started beside it (``--engine``), as a GPU machine's
SGLang server is used (bench/gpu_real_model.py).
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from fake_sglang import local_engine
from trainlib import run_micro_demo


def run_demo(out, *extra: str) -> list[float]:
    # the steps end each run, never the clock (as in test_real_model_learning): --minutes and
    # the timeouts only stop a run that hangs
    rows = run_micro_demo(out, "--minutes", "10", "--run", "learn", *extra, timeout=660)
    return [float(row["reward_mean_trained"]) for row in rows]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


@pytest.mark.long(65)
@pytest.mark.timeout(1500)
def test_reward_rises_with_learning_and_not_without(tmp_path, tiny_dir):
    learned = run_demo(tmp_path / "lr", "--lr", "3e-3", "--steps", "40")
    assert len(learned) == 40
    assert mean(learned[-5:]) >= mean(learned[:5]) + 0.3, learned

    with local_engine(tiny_dir) as url:
        frozen = run_demo(tmp_path / "lr0", "--lr", "0", "--steps", "15", "--engine", url)
        with urllib.request.urlopen(f"{url}/model_info", timeout=10) as resp:
            served = json.load(resp)["weight_version"]
    assert len(frozen) == 15
    # the demo started no engine of its own and its syncer loaded versions into this one
    assert not (tmp_path / "lr0" / "logs" / "engine.log").exists()
    assert served is not None and int(served) >= 1, served
    assert mean(frozen[-5:]) < mean(frozen[:5]) + 0.1, frozen
    assert (tmp_path / "lr" / "reward.png").stat().st_size > 0
