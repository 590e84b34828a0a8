"""bench/program_rollouts.py's program agents and its check, through `agentarium consumer` on an
SGLang fake answering real tiny-model tokens and a real nats-server: the bench's two programs
(Python's urllib; sh and curl) each make the one call the trajectory records, and the check the
bench runs on every batch passes them and refuses a program whose printed reply is not the
recorded one."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
from clilib import consume

_path = list(sys.path)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import program_rollouts  # noqa: E402

sys.path[:] = _path  # bench/agents.py would hide the openai-agents package, `agents`

from agentarium.producers import TaskProducer, TrajectoryReader  # noqa: E402

MODES = ("program-python", "program-sh")


async def test_the_bench_agents_make_one_recorded_call_each(nats_url, js, topology, replying):
    engine = await replying("five")
    programs = program_rollouts.readable_programs()
    try:
        await run_and_check(nats_url, js, topology, engine.url, program_rollouts.modes(programs))
    finally:
        shutil.rmtree(programs)


async def run_and_check(nats_url: str, js, topology, llm: str, specs: dict[str, str]) -> None:
    tasks = [{"task_id": f"t{i}", "prompt": f"repeat {i} of smoke"} for i in range(2)]
    prompts = {t["task_id"]: t["prompt"] for t in tasks}
    ids = {}
    for mode in MODES:
        ids[mode] = set((await TaskProducer(js, topology).submit(mode, tasks, run="smoke")).job_ids)
    for mode in MODES:  # one agent per consumer
        assert await consume(nats_url, "--agent", f"{mode}={specs[mode]}", "--llm", llm) == 0
        trajectories = await TrajectoryReader(js, topology).read("smoke", mode)
        program_rollouts.check(mode, trajectories, ids[mode], prompts)  # raises on a problem
    # a program that printed another reply than the call recorded is refused
    [first, *_] = await TrajectoryReader(js, topology).read("smoke", "program-python")
    program = dict(first.metadata["program"])
    reply = json.loads(program["stdout"].splitlines()[0])
    reply["choices"][0]["message"]["content"] += " (not what the model said)"
    program["stdout"] = json.dumps(reply) + '\n{"reward": 0.0}\n'
    forged = dataclasses.replace(first, metadata={**first.metadata, "program": program})
    with pytest.raises(RuntimeError, match="not the recorded call's"):
        program_rollouts.check("program-python", [forged], {first.job_id}, prompts)
