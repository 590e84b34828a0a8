"""The shell environment's tasks: what one looks like, how a file of them loads, how it scores.

A task, one JSON object per line of a ``.jsonl`` file (``examples/shell_tasks.jsonl``), in the
manner of AgentBench's OS interaction tasks::

    {"id": "count-logs",
     "description": "How many .log files are under logs/ (recursively)?",
     "init": "mkdir -p logs/a && touch logs/x.log logs/a/y.log",      # optional, bash
     "evaluation": {"answer_from": "find logs -name '*.log' | wc -l"},
     "reference": {"commands": ["find logs -name '*.log' | wc -l"], "answer_is_output": true}}

``evaluation`` is one of:

- ``{"answer": "42"}``: the committed answer, stripped, equals this;
- ``{"regex": "^4[0-9]$"}``: the stripped answer matches (``re.search``);
- ``{"answer_from": "script"}``: the stripped output of this script, run right after ``init``
  (before the agent can change anything), is the expected answer;
- ``{"check": "script"}``: run in the session directory after the episode with the answer (or
  "" after ``finish``) as ``$1``; exit status 0 passes. This scores the final state.

``reference`` (optional) is a known solution, for tests and for checking a task file: the
commands to run, then ``"answer"`` (a literal), ``"answer_is_output": true`` (the stripped
output of the last command) or neither (call ``finish``).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

EVALUATIONS = ("answer", "regex", "answer_from", "check")


class TaskError(ValueError):
    """A task (or task file) that cannot be used: the message names the task and the field."""


@dataclass(frozen=True, kw_only=True)
class ShellTask:
    id: str
    description: str
    evaluation: dict
    init: str = ""
    reference: dict = field(default_factory=dict)

    @property
    def kind(self) -> str:
        """Which of EVALUATIONS scores it."""
        return next(k for k in EVALUATIONS if k in self.evaluation)

    @classmethod
    def from_dict(cls, data: dict, *, where: str = "task") -> ShellTask:
        if not isinstance(data, dict):
            raise TaskError(f"{where}: expected a JSON object, got {type(data).__name__}")
        where = f"{where} {data.get('id', '')!r}".rstrip(" '")
        description = data.get("description")
        if not isinstance(description, str) or not description.strip():
            raise TaskError(f"{where}: 'description' must be a non-empty string")
        evaluation = data.get("evaluation")
        kinds = [k for k in EVALUATIONS if isinstance(evaluation, dict) and k in evaluation]
        if len(kinds) != 1:
            raise TaskError(
                f"{where}: 'evaluation' must be an object with exactly one of {EVALUATIONS}"
            )
        if not isinstance(evaluation[kinds[0]], str):  # type: ignore[index]
            raise TaskError(f"{where}: evaluation.{kinds[0]} must be a string")
        if kinds[0] == "regex":
            try:
                re.compile(evaluation["regex"])  # type: ignore[index]
            except re.error as exc:
                raise TaskError(f"{where}: evaluation.regex does not compile: {exc}") from exc
        init = data.get("init", "")
        if not isinstance(init, str):
            raise TaskError(f"{where}: 'init' must be a bash script (a string)")
        reference = data.get("reference") or {}
        if not isinstance(reference, dict) or not isinstance(reference.get("commands", []), list):
            raise TaskError(f"{where}: 'reference' must be an object with a 'commands' list")
        return cls(
            id=str(data.get("id", "")),
            description=description,
            evaluation=dict(evaluation),  # type: ignore[arg-type]
            init=init,
            reference=dict(reference),
        )


def load_tasks(path: str | Path) -> dict[str, ShellTask]:
    """The tasks of a ``.jsonl`` file by id, in file order (cached per file and mtime)."""
    path = Path(path)
    try:
        mtime = path.stat().st_mtime_ns
    except OSError as exc:
        raise TaskError(f"cannot read the shell task file {path}: {exc}") from exc
    return _load(str(path), mtime)


@functools.lru_cache(maxsize=8)
def _load(path: str, mtime: int) -> dict[str, ShellTask]:
    tasks: dict[str, ShellTask] = {}
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            data = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskError(f"{where}: not JSON: {exc}") from exc
        task = ShellTask.from_dict(data, where=where)
        if not task.id:
            raise TaskError(f"{where}: every task in a file needs an 'id'")
        if task.id in tasks:
            raise TaskError(f"{where}: duplicate id {task.id!r}")
        tasks[task.id] = task
    return tasks


def matches(task: ShellTask, answer: str, expected: str | None) -> bool:
    """Score an answer for the answer-type evaluations (``check`` runs in the sandbox)."""
    answer = answer.strip()
    if task.kind == "answer":
        return answer == task.evaluation["answer"].strip()
    if task.kind == "regex":
        return re.search(task.evaluation["regex"], answer) is not None
    if task.kind == "answer_from":
        return expected is not None and answer == expected.strip()
    raise ValueError(f"task {task.id!r} is scored by a check script, not by matching")
