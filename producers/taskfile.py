"""Task files: one JSON object per line (blank lines skipped), read in one place.

``agentarium produce`` and ``agentarium eval run`` read them; an error names the file and
the line.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from schemas import SchemaError


def read_tasks(lines: Iterable[str], source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Parse JSONL into task objects and their 1-based line numbers; a bad line names itself."""
    tasks, line_numbers = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SchemaError(
                f"{source}:{number}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from exc
        if not isinstance(task, dict):
            raise SchemaError(
                f"{source}:{number}: a task must be a JSON object, got {type(task).__name__}"
            )
        tasks.append(task)
        line_numbers.append(number)
    return tasks, line_numbers
