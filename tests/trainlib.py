"""What trainer tests share: groups of 4 one-call trajectories on the tiny model's byte-level
tokens, published where a trainer reads them; the tiny trainer's settings; and ``agentarium
demo`` on the micro-task the learning tests train."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentarium.tiny import ensure_tiny_model
from schemas import LLMCall, Trajectory, encode
from trainer.config import TrainerConfig
from trainer.metrics import read_metrics

# Every answer is 7 (no conditioning needed), no entropy bonus, fixed seeds.
MICRO_TASK = ("--digits", "7", "--groups-per-step", "8", "--group-size", "8", "--entropy-coef", "0")


def one_call_group(
    g: int,
    *,
    run: str,
    agent: str,
    job_id: Callable[[int, int], str],
    group_id: str,
    reward: Callable[[int, int], float],
    version: str = "default",
    trace: bool = False,
) -> list[Trajectory]:
    """Group ``g``: 4 members whose reply is digit ``i``, scored by ``reward(g, i)``."""
    out = []
    for i in range(4):
        call = LLMCall(
            prompt_ids=[257, 48 + g, 258],
            response_ids=[48 + i, 258],
            response_logprobs=[-5.5, -5.6],
            finish_reason="stop",
            weight_version=version,
        )
        out.append(
            Trajectory(
                job_id=job_id(g, i),
                agent=agent,
                task_id=f"t{g}",
                group_id=group_id,
                group_size=4,
                run=run,
                status="ok",
                reward=reward(g, i),
                calls=[call],
                trace_id=f"{g + 1:016x}{i + 1:016x}" if trace else "",
            )
        )
    return out


async def publish(js, topology, trajectories: list[Trajectory]) -> None:
    for traj in trajectories:
        subject = topology.trajectory_subject(traj.run, traj.agent, traj.job_id)
        await js.publish(subject, encode(traj))


def tiny_config(**settings: Any) -> TrainerConfig:
    """The tiny model, 2 groups of 4 a step at lr 1e-3, and ``settings`` (run, agent, ...)."""
    values = dict(model_dir=str(ensure_tiny_model()), group_size=4, groups_per_step=2, lr=1e-3)
    return TrainerConfig(**{**values, **settings})


def run_micro_demo(out: Path, *flags: str, timeout: float) -> list[dict[str, str]]:
    """``agentarium demo --out out`` on the micro-task, seed 1, then ``flags``; the trainer's
    metrics rows."""
    argv = [sys.executable, "-m", "agentarium", "demo", "--out", str(out), *MICRO_TASK]
    result = subprocess.run(
        [*argv, "--seed", "1", *flags], capture_output=True, text=True, timeout=timeout
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return read_metrics(out / "metrics.csv")
