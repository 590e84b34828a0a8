"""What trainer tests share: groups of 4 one-call trajectories on the tiny model's byte-level
tokens, published where a trainer reads them; the tiny trainer's settings; the trainer as a
child process (``TrainerChild``); and ``agentarium demo`` on the micro-task the learning tests
train."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from agentarium.demo.processes import child_env
from agentarium.schemas import LLMCall, Trajectory, WeightIdentity, encode
from agentarium.tiny import ensure_tiny_model
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[1]
# Every answer is 7 (no conditioning needed), no entropy bonus, fixed seeds.
MICRO_TASK = ("--digits", "7", "--groups-per-step", "8", "--group-size", "8", "--entropy-coef", "0")


def served(run: str, version: int) -> str:
    """The ``weight_version`` an engine reports for ``run``'s version (``"default"``, the base
    weights, for 0), with a checksum made up from the version."""
    if version == 0:
        return "default"
    return str(WeightIdentity(run, version, f"{version:016x}"))


def short_call(**fields: Any) -> LLMCall:
    """One LLM call: a 3-token prompt and a 2-token reply with its log-probs; ``fields`` on top
    (``weight_version``, ``top_p``, ...)."""
    reply = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "response_logprobs": [-0.5, -0.25]}
    return LLMCall(**{**reply, "finish_reason": "stop", **fields})


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


class TrainerChild:
    """``python -m agentarium trainer`` on the tiny model (groups of 4, checkpoints and
    metrics.csv in ``workdir``), its JSON log events collected as they come."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.events: list[dict] = []
        self._changed = asyncio.Condition()
        self._reader = asyncio.create_task(self._read())

    @classmethod
    async def start(
        cls, url: str, workdir: Path, *extra: str, run: str, agent: str
    ) -> TrainerChild:
        args = [
            sys.executable, "-m", "agentarium", "trainer", "--nats-url", url,
            "--run", run, "--agent", agent, "--model", str(ensure_tiny_model()),
            "--group-size", "4", "--lr", "1e-3", "--max-staleness", "1000",
            "--checkpoint-dir", str(workdir / "ckpt"), "--metrics", str(workdir / "metrics.csv"),
            "--torch-threads", "1", *extra,
        ]  # fmt: skip
        proc = await asyncio.create_subprocess_exec(
            *args,
            cwd=ROOT,
            env=child_env(PYTHONPATH=str(ROOT), AGENTARIUM_LOG_FORMAT="json"),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        return cls(proc)

    async def _read(self) -> None:
        assert self.proc.stderr is not None
        while line := await self.proc.stderr.readline():
            try:
                record = json.loads(line)
            except ValueError:
                continue
            record["_at"] = time.time()
            async with self._changed:
                self.events.append(record)
                self._changed.notify_all()
        async with self._changed:
            self.events.append({"event": "_exited", "_at": time.time()})
            self._changed.notify_all()

    async def wait_for(self, event: str, timeout_s: float = 180.0, **fields) -> dict:
        """The first event named ``event`` with ``fields`` since the start, once it came."""

        def found() -> dict | None:
            for record in self.events:
                if record.get("event") == event and all(
                    record.get(k) == v for k, v in fields.items()
                ):
                    return record
                if record.get("event") == "_exited":
                    raise AssertionError(
                        f"trainer exited before {event} {fields}: {self.events[-5:]}"
                    )
            return None

        async with asyncio.timeout(timeout_s), self._changed:
            while (record := found()) is None:
                await self._changed.wait()
            return record

    def steps_done(self) -> list[int]:
        return [e["step"] for e in self.events if e.get("event") == "step done"]

    def checkpointed(self) -> int:
        return max(
            (e["step"] for e in self.events if e.get("event") == "checkpoint saved"), default=0
        )

    def resumed_step(self) -> int:
        """The step a resumed trainer started from (0 for a fresh one)."""
        return next((e["step"] for e in self.events if e.get("event") == "resumed"), 0)

    async def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        await self.proc.wait()
        await self._reader

    async def exit_code(self, timeout_s: float = 180.0) -> int:
        async with asyncio.timeout(timeout_s):
            await self._reader
            return await self.proc.wait()
