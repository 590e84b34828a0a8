"""Task files, read in one place: JSON lines, or parquet (verl's dataset format) by extension.

``agentarium produce``, ``agentarium eval run`` and the demo read them with
``read_task_file``; an error names the file and the line (or row).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

from agentarium.schemas import SchemaError

PARQUET_SUFFIXES = (".parquet", ".pq")


class TaskFileError(SchemaError):
    """A task file cannot be read: missing, malformed, or its format's reader not installed."""


class TaskFile(NamedTuple):
    """The tasks of a file, each with its 1-based position: a line (JSON lines) or a row."""

    tasks: list[dict[str, Any]]
    positions: list[int]
    unit: str  # "line" or "row"


def read_task_file(path: str | Path) -> TaskFile:
    """JSON lines, or parquet when the name ends in .parquet; ``-`` reads JSON lines on stdin."""
    if str(path) == "-":
        tasks, lines = read_tasks(sys.stdin, "<stdin>")
        return TaskFile(tasks, lines, "line")
    path = Path(path)
    if path.suffix.lower() in PARQUET_SUFFIXES:
        from .parquet_tasks import read_parquet_tasks  # pyarrow loads only for parquet files

        tasks = read_parquet_tasks(path)
        return TaskFile(tasks, list(range(1, len(tasks) + 1)), "row")
    try:
        with open(path, encoding="utf-8") as handle:
            tasks, lines = read_tasks(handle, str(path))
    except OSError as exc:
        raise TaskFileError(f"cannot read tasks file {str(path)!r}: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise TaskFileError(
            f"{path} is not UTF-8 text ({exc.reason}): JSON lines are UTF-8; a parquet file "
            "needs the .parquet extension"
        ) from exc
    return TaskFile(tasks, lines, "line")


def read_tasks(lines: Iterable[str], source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Parse JSONL into task objects and their 1-based line numbers; a bad line names itself."""
    tasks, line_numbers = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TaskFileError(
                f"{source}:{number}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from exc
        if not isinstance(task, dict):
            raise TaskFileError(
                f"{source}:{number}: a task must be a JSON object, got {type(task).__name__}"
            )
        tasks.append(task)
        line_numbers.append(number)
    return tasks, line_numbers
