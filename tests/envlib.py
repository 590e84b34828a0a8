"""Environments used by the tests (served by module path in `agentarium env serve` subprocesses
too: ``envlib:EchoEnv``).

``EchoEnv`` answers each tool call with what it was asked, and the task steers it: ``big``
(bytes of reply), ``sleep`` (seconds per step), ``reset_sleep``, ``raise_on_step`` (the step
number that raises), ``done_after`` (steps), ``mark`` (a key under which the test counts what
ran). Counts live on the class, so a test in the same process can assert a step ran once.

``solve_sql`` is a scripted policy for the shipped ``sql`` tasks (tests/fake_sglang.py's
``scripted`` serves it as a model). ``serve_process`` runs `agentarium env serve` as a child;
``sql_worker`` runs an `sql` environment worker in the test's own process.
"""

from __future__ import annotations

import ast
import asyncio
import json
import os
import sys
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from agentarium.broker import Topology
from agentarium.environments import Environment, EnvWorker, EnvWorkerConfig, SqlEnvironment
from agentarium.environments.sql import load_tasks as load_sql_tasks
from agentarium.schemas import Observation, SessionOutcome, StepResult


class EchoEnv(Environment):
    name = "echo"
    runs: Counter = Counter()  # (mark, seq) -> times a step ran
    resets_now = 0
    most_resets_at_once = 0
    closed: dict[str, asyncio.Event] = {}  # mark -> set when that session's env closed

    def __init__(self) -> None:
        self.instance = uuid.uuid4().hex
        self.task: dict = {}
        self.steps = 0

    async def reset(self, task: dict) -> Observation:
        if task.get("bad"):
            raise ValueError("this task is marked bad")
        self.task = task
        cls = type(self)
        cls.resets_now += 1
        cls.most_resets_at_once = max(cls.most_resets_at_once, cls.resets_now)
        try:
            if task.get("reset_sleep"):
                await asyncio.sleep(task["reset_sleep"])
        finally:
            cls.resets_now -= 1
        text = "x" * int(task.get("big_reset", 0)) or f"hello {task.get('mark', '')}"
        return Observation(
            messages=[{"role": "user", "content": text}],
            tools=[{"type": "function", "function": {"name": "echo", "parameters": {}}}],
            info={"instance": self.instance},
        )

    async def step(self, action: dict) -> StepResult:
        self.steps += 1
        type(self).runs[(self.task.get("mark", ""), self.steps)] += 1
        if self.task.get("raise_on_step") == self.steps:
            raise RuntimeError(f"echo broke on step {self.steps}")
        if self.task.get("sleep"):
            await asyncio.sleep(self.task["sleep"])
        content = (
            "y" * int(self.task["big"]) if self.task.get("big") else str(action.get("content"))
        )
        content = "\x01" * int(self.task.get("control_chars", 0)) or content  # 6 bytes each in JSON
        done = self.steps >= int(self.task.get("done_after", 10**9))
        return StepResult(
            messages=[{"role": "tool", "tool_call_id": "c", "content": content}],
            reward=1.0 if done else None,
            done=done,
            info={"instance": self.instance, "step": self.steps},
        )

    async def close(self) -> SessionOutcome:
        mark = self.task.get("mark")
        if mark in type(self).closed:
            type(self).closed[mark].set()
        info = {"blob": "z" * int(self.task["big_info"])} if self.task.get("big_info") else {}
        return SessionOutcome(
            score=float(self.steps), metrics={"steps": float(self.steps)}, info=info
        )


# ---- a scripted policy that solves the shipped sql tasks ----------------------------------------


def tool_call_text(name: str, arguments: dict) -> str:
    """A Hermes tool call as the tiny model's chat template renders one in the history, so a
    scripted reply and its rendering in the next prompt are the same tokens."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def solve_sql(prompt: str) -> str:
    """The next tool call of a policy that knows each task's reference SQL, found by the
    question in the prompt: run it, then commit the rows it returned ("done" for an update)."""
    tasks = [t for t in load_sql_tasks().values() if t["question"] in prompt]
    if not tasks:
        return "I do not know this task."
    task = max(tasks, key=lambda t: len(t["question"]))
    if "<tool_response>" not in prompt:
        return tool_call_text("execute_sql", {"query": task["sql"]})
    result = prompt.rsplit("<tool_response>\n", 1)[1].split("\n</tool_response>", 1)[0]
    if task["kind"] == "update":
        answer = ["done"]
    else:
        answer = [str(row[0]) for row in ast.literal_eval(result)]
    return tool_call_text("commit_final_answer", {"answer": answer})


ROOT = Path(__file__).resolve().parents[1]


@asynccontextmanager
async def serve_process(
    nats_url: str,
    *args: str,
    command: Sequence[str] = ("serve", "envlib:EchoEnv"),
    environ: dict[str, str] | None = None,
) -> AsyncIterator[tuple[asyncio.subprocess.Process, str]]:
    """`agentarium env serve envlib:EchoEnv ARGS` (or ``command``) as a child, once it says it
    serves; yields (process, worker id) and kills what is still running at the end.
    ``environ``: variables to set (or, with the value "", remove) in the child's environment."""
    env = dict(os.environ)
    for key, value in (environ or {}).items():
        if value:
            env[key] = value
        else:
            env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env["AGENTARIUM_LOG_FORMAT"] = "json"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "agentarium", "env", *command, "--nats-url", nats_url, *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, env=env, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
        assert "serving" in line, line
        yield proc, line.split(" worker ")[1].split()[0]
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


@asynccontextmanager
async def sql_worker(settings, **options):
    """An in-process `sql` worker on its own connection."""
    nc = await settings.connect(name="env-worker")
    config = EnvWorkerConfig(name="sql", janitor_interval_s=0.05, **options)
    worker = EnvWorker(nc, Topology(), SqlEnvironment, config)
    await worker.start()
    try:
        yield worker
    finally:
        await worker.stop(grace_s=0)
        await nc.close()
