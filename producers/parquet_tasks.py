"""Parquet task files, as verl keeps its datasets: one task per row, every column a task field.

verl's columns come through as they are: ``prompt`` (a list of chat messages), ``data_source``,
``ability``, ``reward_model`` (``ground_truth``, ``style``) and ``extra_info`` (``index``, ...).
Structs become dicts and lists lists, so an agent reads ``task["reward_model"]["ground_truth"]``.
Like verl's own loaders (datasets, pandas), a struct field some rows lack is None in theirs.
Reading needs pyarrow, the ``parquet`` extra.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .taskfile import TaskFileError


def read_parquet_tasks(path: Path) -> list[dict[str, Any]]:
    """Every row as a task dict; a value JSON cannot carry is refused with its row and column."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise TaskFileError(
            f"{path}: reading parquet task files needs pyarrow: pip install 'agentarium[parquet]' "
            "(or pip install pyarrow), or write the tasks as JSON lines"
        ) from None
    try:
        rows = pq.read_table(path).to_pylist()
    except OSError as exc:
        raise TaskFileError(f"cannot read tasks file {str(path)!r}: {exc}") from exc
    except (pa.ArrowException, ValueError) as exc:
        raise TaskFileError(f"{path} is not a parquet file pyarrow can read: {exc}") from exc
    for number, row in enumerate(rows, start=1):
        for column, value in row.items():
            problem = _not_json(value)
            if problem:
                raise TaskFileError(
                    f"{path}: row {number}, column {column!r}: {problem}; tasks travel as JSON "
                    "(strings, numbers, bools, lists, structs): cast or drop that column"
                )
    return rows


def _not_json(value: Any) -> str:
    """Why ``value`` cannot be sent as JSON, or ''."""
    if isinstance(value, float) and not math.isfinite(value):
        return f"{value} is not a JSON number"
    if isinstance(value, dict):
        return next((p for p in map(_not_json, value.values()) if p), "")
    if isinstance(value, list):
        return next((p for p in map(_not_json, value) if p), "")
    try:
        json.dumps(value)
    except (TypeError, ValueError):
        return f"a {type(value).__name__} value"
    return ""
