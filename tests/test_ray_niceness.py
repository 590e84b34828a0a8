"""A Ray the trainer or the orchestrator starts itself runs its workers at nice 0.

Ray's own default is nice 15, which leaves a worker about 3 % of a core beside one busy nice-0
process: the trainer's ranks and the orchestrator's consumer actors are the work, not
background jobs (docs/design.md). tests/conftest.py sets ``RAY_worker_niceness=0`` for every
Ray the suite starts; each child here runs without it, as a user's process would."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[1]

TRAINER = """
import os, sys
import ray
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.ray_dp import RayDataParallel

dp = RayDataParallel(TrainerConfig(run="r", agent="a", model_dir=sys.argv[1]), 1)
try:
    print("nice", ray.get(dp.actors[0].__ray_call__.remote(lambda self: os.nice(0))))
finally:
    dp.close()
    ray.shutdown()
"""

ORCHESTRATOR = """
import os
import ray
from agentarium.orchestrator.ray_consumers import RayConfig, ensure_ray

ensure_ray(RayConfig())
print("nice", ray.get(ray.remote(lambda: os.nice(0)).remote()))
ray.shutdown()
"""


def niceness_in_a_child(script: str, *args: str) -> list[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_worker_niceness", "RAY_ADDRESS")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    argv = [sys.executable, "-c", script, *args]
    result = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.splitlines()


def test_the_trainers_ranks_run_at_nice_0(tiny_dir):
    assert "nice 0" in niceness_in_a_child(TRAINER, str(tiny_dir))


def test_the_orchestrators_ray_runs_its_workers_at_nice_0():
    assert "nice 0" in niceness_in_a_child(ORCHESTRATOR)
