"""The ``shell`` environment: tasks solved with bash commands, in the manner of AgentBench's
OS interaction, each session in its own sandbox (``sandbox/``: namespaces, a cgroup, a uid).

The agent gets the task's description and three tools: ``bash(command)`` runs a command in the
session's directory (a fresh ``bash -c`` each call), ``commit_final_answer(answer)`` answers a
question, ``finish()`` says a task that changes files is done. Either ends the episode and
scores it (``shell_tasks.py``: an expected answer, or a check script on the final state); the
reward is 1 or 0. Bad actions (arguments that are not JSON, unknown tools, no tool call, a
command past a limit) get an observation saying so; none raises.
"""

from __future__ import annotations

import json
import signal
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import structlog

from agentarium.schemas import Observation, SessionOutcome, StepResult

from .base import Environment
from .sandbox import CommandResult, Sandbox, SandboxLimits, human_bytes, isolation, sweep
from .sandbox.uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT, default_uid_lock_dir
from .shell_tasks import ShellTask, TaskError, load_tasks, matches

log = structlog.get_logger("agentarium.environments")

# the repository root in a checkout, the agentarium package in a wheel: both hold examples/
TASKS_FILE = Path(__file__).resolve().parents[1] / "examples" / "shell_tasks.jsonl"

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": (
                "Run a bash command in your working directory and see its output (stdout and "
                "stderr). Each call starts a fresh shell there: cd and variables do not carry "
                "over, so chain with && or ;. There is no network and no input."
            ),
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string", "description": "the bash command"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "commit_final_answer",
            "description": "Give your final answer to the question; this ends the task.",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "just the answer"}},
                "required": ["answer"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "finish",
            "description": "Say that you have done what the task asked; this ends the task.",
            "parameters": {"type": "object", "properties": {}},
        },
    },
]
TOOL_NAMES = [t["function"]["name"] for t in TOOLS]

SYSTEM_PROMPT = (
    "You are an assistant working in a Linux shell. Solve the task with the bash tool, one "
    "command per call. If the task asks a question, answer it with commit_final_answer (the "
    "answer only, no explanation); if it asks you to change files, call finish when done."
)

# Why the kernel killed a command (the signal, or bash's 128 + signal for a child).
SIGNAL_NOTES = {
    signal.SIGXCPU: "killed: CPU time limit ({cpu_s} s)",
    signal.SIGXFSZ: "killed: file size limit ({file_size_bytes} bytes)",
    signal.SIGKILL: "killed (SIGKILL)",
    signal.SIGSEGV: "crashed (SIGSEGV; the memory limit is {memory_bytes} bytes)",
}
# The session limits a command ran into (CommandResult.hit), whatever else happened.
HIT_NOTES = {
    "memory": "killed: session memory limit {session_memory}",
    "nproc": "the session's process limit ({nproc} processes) was reached: forks failed",
    "disk": "no space left: the working directory's disk limit is {disk}",
    "tmp": "/tmp is full (its limit is {tmp})",
    "shm": "/dev/shm is full (its limit is {tmp})",
}


def describe(result: CommandResult, limits: SandboxLimits) -> str:
    """A command's result as the agent reads it: the output, then what happened."""
    text = result.output if result.output else "(no output)\n"
    if not text.endswith("\n"):
        text += "\n"
    sizes = {
        "session_memory": human_bytes(limits.session_memory_bytes),
        "disk": human_bytes(limits.disk_bytes),
        "tmp": human_bytes(limits.tmp_bytes),
        "nproc": limits.nproc,
    }
    hits = [HIT_NOTES[h].format(**sizes) for h in result.hit if h in HIT_NOTES]
    if result.stopped == "wall":
        note = f"stopped: it ran past the wall-time limit ({limits.wall_s:g} s)"
    elif result.stopped == "cpu":
        note = f"killed: session CPU time limit ({limits.cpu_s} s)"
    elif result.stopped == "output":
        note = (
            f"output cut at {limits.output_bytes} bytes and the command stopped: "
            "print less (head, tail, grep, wc)"
        )
    else:
        code = result.exit_code
        sig = -code if code < 0 else code - 128 if 128 < code < 160 else 0
        note = f"exit code {code}"
        if sig == signal.SIGKILL and "memory" in result.hit:
            pass  # the session memory note says why
        elif sig in SIGNAL_NOTES:
            note += "; " + SIGNAL_NOTES[signal.Signals(sig)].format(**asdict(limits))
        if result.stopped == "background":
            note += "; a background process kept the output open, the rest is discarded"
    return f"{text}[{'; '.join([note, *hits])}]"


def _arguments(call: dict) -> tuple[str, dict | None, str]:
    """(tool name, arguments or None, error) of one OpenAI-style tool call."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        return "", None, "malformed tool call: expected {'function': {'name', 'arguments'}}"
    name, raw = function["name"], function.get("arguments", "{}")
    if isinstance(raw, dict):
        return name, raw, ""
    try:
        args = json.loads(raw or "{}")
    except (TypeError, ValueError) as exc:
        return name, None, f"the arguments of {name} are not valid JSON ({exc}): {str(raw)[:200]}"
    if not isinstance(args, dict):
        return name, None, f"the arguments of {name} must be a JSON object, got {str(raw)[:200]}"
    return name, args, ""


class ShellEnvironment(Environment):
    """One session: a sandbox, a task, the steps until the agent answers or finishes.

    Options (``agentarium env serve shell`` passes them as keywords): ``tasks_file`` (for
    ``{"index": id}`` tasks), ``max_steps``, ``limits`` (SandboxLimits or a dict of its fields),
    ``base_dir`` (the sessions' folders in the weaker modes), ``uid_base``, ``uid_count`` and
    ``uid_lock_dir`` (the uid range sessions lease as root, and where the leases are: one
    directory for every worker of the machine), ``hide`` (more host paths a session must not
    see; the project's folder and the tasks file always are), ``allow_weaker_sandbox`` (serve
    where the host lacks some isolation, ``Isolation.missing``; refused otherwise).

    The answers stay out of the session's reach: the tasks file is hidden from it, expected
    answers live in the worker's memory, an ``answer_from`` script runs before the agent's first
    command and a ``check`` script only after every process of the session has been ended.
    """

    name = "shell"
    tasks_file: Path = TASKS_FILE

    def __init__(
        self,
        *,
        tasks_file: str | Path | None = None,
        max_steps: int = 30,
        limits: SandboxLimits | dict | None = None,
        base_dir: str | Path | None = None,
        uid_base: int | None = None,
        uid_count: int | None = None,
        uid_lock_dir: str | Path | None = None,
        hide: list[str] | tuple[str, ...] = (),
        allow_weaker_sandbox: bool = False,
    ) -> None:
        if tasks_file is not None:
            self.tasks_file = Path(tasks_file)
        if isinstance(limits, dict):
            limits = SandboxLimits(**limits)
        self.limits = limits or SandboxLimits()
        self.max_steps = int(max_steps)
        self._box_options: dict[str, Any] = {
            "limits": self.limits,
            "base_dir": base_dir,
            "hide": (self.tasks_file, *hide),
            "allow_weaker": bool(allow_weaker_sandbox),
        }
        if uid_base is not None:
            self._box_options["uid_base"] = int(uid_base)
        if uid_count is not None:
            self._box_options["uid_count"] = int(uid_count)
        if uid_lock_dir is not None:
            self._box_options["uid_lock_dir"] = uid_lock_dir
        self.box: Sandbox | None = None
        self.task: ShellTask | None = None
        self.steps = 0
        self.expected: str | None = None
        self.answer: str | None = None
        self.score: float | None = None
        self.counts = {"commands": 0, "invalid_calls": 0, "limit_stops": 0, "nonzero_exits": 0}
        self.command_seconds = 0.0
        self.reason = ""

    @classmethod
    def indices(cls) -> list[str]:
        return list(load_tasks(cls.tasks_file))

    @classmethod
    def preflight(cls, options: dict[str, Any]) -> None:
        """Refuse a host whose sandbox lacks isolation, unless ``allow_weaker_sandbox``; then
        sweep what crashed workers left (cgroups, processes and folders of free uids)."""
        found = isolation()
        if found.missing and not options.get("allow_weaker_sandbox"):
            raise ValueError(found.refusal())
        base_dir = options.get("base_dir")
        sweep(
            uid_lock_dir=Path(options.get("uid_lock_dir") or default_uid_lock_dir()),
            uid_base=int(options.get("uid_base") or DEFAULT_UID_BASE),
            uid_count=int(options.get("uid_count") or DEFAULT_UID_COUNT),
            base_dir=Path(base_dir) if base_dir else None,
        )

    def _task(self, task: dict) -> ShellTask:
        if "index" in task and "description" not in task:
            tasks = load_tasks(self.tasks_file)
            index = str(task["index"])
            if index not in tasks:
                raise TaskError(f"no shell task {index!r} in {self.tasks_file}")
            return tasks[index]
        return ShellTask.from_dict(task)

    async def reset(self, task: dict) -> Observation:
        self.task = self._task(task)
        self.box = await Sandbox.open(**self._box_options)
        try:
            await self._prepare()
        except BaseException:
            await self.box.close()
            self.box = None
            raise
        return Observation(
            messages=[
                {"role": "system", "content": SYSTEM_PROMPT},
                {"role": "user", "content": self.task.description},
            ],
            tools=TOOLS,
            info={
                "task_id": self.task.id,
                "sandbox": self.box.isolation.as_dict(),
                "limits": asdict(self.limits),
            },
        )

    async def _prepare(self) -> None:
        """Run the task's init script, then its answer_from script."""
        assert self.box is not None and self.task is not None
        if self.task.init:
            done = await self.box.run(self.task.init)
            if done.exit_code != 0 or done.stopped:
                raise TaskError(
                    f"the init script of task {self.task.id!r} failed: "
                    + describe(done, self.limits)[-500:]
                )
        if self.task.kind == "answer_from":
            done = await self.box.run(self.task.evaluation["answer_from"])
            if done.exit_code != 0 or done.stopped:
                raise TaskError(f"the answer_from script of task {self.task.id!r} failed")
            self.expected = done.output.strip()
        await self.box.kill_all()  # nothing the preparation started is left for the agent

    async def step(self, action: dict) -> StepResult:
        if self.box is None or self.task is None:
            raise RuntimeError("step before reset")
        self.steps += 1
        messages: list[dict] = []
        truncated = False
        calls = action.get("tool_calls") or []
        if self.score is not None:
            return StepResult(seq=self.steps, done=True, info={"reason": "the episode is over"})
        if not isinstance(calls, list) or not calls:
            self.counts["invalid_calls"] += 1
            messages.append(
                {
                    "role": "user",
                    "content": "No tool call found. Call one of: " + ", ".join(TOOL_NAMES) + ".",
                }
            )
        for call in calls if isinstance(calls, list) else []:
            call_id = str(call.get("id", "")) if isinstance(call, dict) else ""
            if self.score is not None:
                content = "Not run: the episode is over."
            else:
                content, cut = await self._call(call)
                truncated = truncated or cut
            messages.append({"role": "tool", "tool_call_id": call_id, "content": content})
        if self.score is None and self.steps >= self.max_steps:
            self.reason = f"step limit ({self.max_steps}) reached without an answer"
            self.score = 0.0
        info = {"reason": self.reason} if self.reason else {}
        return StepResult(
            seq=self.steps,
            messages=messages,
            reward=self.score,
            done=self.score is not None,
            truncated=truncated,
            info=info,
        )

    async def _call(self, call: dict) -> tuple[str, bool]:
        """Run one tool call: (the tool message's content, whether output was cut)."""
        assert self.box is not None
        name, args, error = _arguments(call)
        if args is not None and name not in TOOL_NAMES:
            error = f"unknown tool {name!r}; the tools are: {', '.join(TOOL_NAMES)}"
        if args is not None and name == "bash" and not isinstance(args.get("command"), str):
            error = 'bash needs {"command": "<a bash command>"}'
        if error:
            self.counts["invalid_calls"] += 1
            return f"Error: {error}", False
        assert args is not None
        if name == "bash":
            done = await self.box.run(args["command"])
            self.counts["commands"] += 1
            self.counts["limit_stops"] += done.stopped in ("wall", "output")
            self.counts["nonzero_exits"] += done.exit_code != 0
            self.command_seconds += done.seconds
            return describe(done, self.limits), done.truncated
        answer = args.get("answer", "") if name == "commit_final_answer" else ""
        self.answer = answer if isinstance(answer, str) else json.dumps(answer)
        self.score = await self._evaluate(self.answer)
        self.reason = "answered" if name == "commit_final_answer" else "finished"
        return f"Recorded. The task is over ({self.reason}).", False

    async def _evaluate(self, answer: str) -> float:
        assert self.box is not None and self.task is not None
        if self.task.kind != "check":
            return float(matches(self.task, answer, self.expected))
        # Every process of the session ends first: nothing left running changes the state under
        # the check, and nothing of the agent's sees the check's script or arguments.
        await self.box.kill_all()
        done = await self.box.run(self.task.evaluation["check"], [answer])
        return float(done.exit_code == 0 and not done.stopped)

    async def close(self) -> SessionOutcome:
        started = time.monotonic()
        try:
            if self.box is not None:
                await self.box.close()
        finally:
            self.box = None
        finished = self.score is not None and self.reason in ("answered", "finished")
        return SessionOutcome(
            score=self.score or 0.0,
            metrics={
                "steps": float(self.steps),
                **{k: float(v) for k, v in self.counts.items()},
                "command_seconds": round(self.command_seconds, 4),
                "close_seconds": round(time.monotonic() - started, 4),
            },
            info={
                "task_id": self.task.id if self.task else "",
                "finished": finished,
                "answer": self.answer,
                "reason": self.reason or "closed before an answer",
            },
            steps=self.steps,
        )
