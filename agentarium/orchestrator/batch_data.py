"""What an RL framework passes as ``data``, turned into jobs: validated before anything is sent.

Accepted shapes:
- a list of task dicts (one row each);
- a dict of equal-length columns (lists or numpy arrays), as verl's ``non_tensor_batch``;
- an object with a ``non_tensor_batch`` dict (a verl ``DataProto``): its columns.

The agent of each row comes from its ``agent_name`` column, else from ``data_source`` when
that names a registered agent, else the default agent (``producers.agent_of``, the rule
``agentarium produce --agent-from`` applies too). Every problem (no rows, ragged
columns, a row without an agent, an agent nobody registered, two rows with one task id) is
a ``BatchDataError`` that says what to change, raised before the first publish.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from agentarium.producers import (
    AGENT_COLUMN,
    SOURCE_COLUMN,
    JobOptions,
    RoutingProblem,
    TaskRow,
    Unrouted,
    agent_of,
    expand_rows,
    task_id_of,
)
from agentarium.schemas import Job, SchemaError

AGENT_COLUMNS = (AGENT_COLUMN, SOURCE_COLUMN)
_SHOW = 5  # rows named in an error message


class BatchDataError(ValueError):
    """The batch cannot be turned into jobs; the message says what to fix."""


@dataclass(frozen=True)
class BatchRow:
    """One task of the batch, with its agent and its id inside the batch."""

    index: int
    agent: str
    task_id: str
    task: dict


def plain(value: Any) -> Any:
    """numpy arrays and scalars (and tuples) as JSON-ready Python values, recursively."""
    if isinstance(value, np.ndarray):
        return [plain(v) for v in value.tolist()] if value.dtype == object else value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def _names(indices: Sequence[int]) -> str:
    shown = ", ".join(str(i) for i in indices[:_SHOW])
    return shown + (f" and {len(indices) - _SHOW} more" if len(indices) > _SHOW else "")


def _is_column(value: Any) -> bool:
    return isinstance(value, (list, tuple, np.ndarray))


def _column_rows(columns: Mapping[str, Any]) -> list[dict]:
    if not columns:
        raise BatchDataError("the batch is empty: pass at least one task")
    not_columns = [k for k, v in columns.items() if not _is_column(v)]
    if len(not_columns) == len(columns):
        raise BatchDataError(
            "data is a dict whose values are not columns: it looks like a single task; pass a "
            "list of task dicts ([task]) or a dict of equal-length lists/arrays"
        )
    if not_columns:
        raise BatchDataError(
            f"columns {not_columns} are not lists or arrays while the others are: every value of "
            "a column dict must be a list or numpy array with one entry per row"
        )
    lengths = {k: len(v) for k, v in columns.items()}
    if len(set(lengths.values())) > 1:
        detail = ", ".join(f"{k}={n}" for k, n in lengths.items())
        raise BatchDataError(
            f"ragged columns ({detail}): every column needs one entry per row; pad or drop the "
            "short ones"
        )
    n = next(iter(lengths.values()))
    plain_columns = {str(k): plain(v) for k, v in columns.items()}
    return [{k: col[i] for k, col in plain_columns.items()} for i in range(n)]


def rows_of(data: Any) -> list[dict]:
    """The batch as a list of plain task dicts (no validation of agents yet)."""
    if data is None:
        raise BatchDataError("data is None: pass a list of task dicts or a dict of columns")
    non_tensor = getattr(data, "non_tensor_batch", None)
    if isinstance(non_tensor, Mapping):
        data = non_tensor
    if isinstance(data, Mapping):
        return _column_rows(data)
    if isinstance(data, (str, bytes)) or not isinstance(data, (Sequence, np.ndarray)):
        raise BatchDataError(
            f"data is a {type(data).__name__}: pass a list of task dicts or a dict of columns"
        )
    rows = []
    bad = []
    for i, row in enumerate(data):
        if isinstance(row, Mapping):
            rows.append(plain(row))
        else:
            bad.append(i)
    if bad:
        raise BatchDataError(
            f"rows {_names(bad)} are not dicts (first: {type(data[bad[0]]).__name__}): every task "
            "must be a dict of JSON values"
        )
    if not rows:
        raise BatchDataError("the batch is empty: pass at least one task")
    return rows


def normalize(
    data: Any, *, registered: Collection[str], default_agent: str | None
) -> list[BatchRow]:
    """Rows with their agent and task id, or a BatchDataError naming every problem."""
    if not registered:
        raise BatchDataError(
            "no agent is registered: call register_agent_type(name, fn, ...) before submitting data"
        )
    if default_agent is not None and default_agent not in registered:
        raise BatchDataError(
            f"default agent {default_agent!r} is not registered (registered: {sorted(registered)})"
        )
    rows = rows_of(data)
    problems: dict[RoutingProblem, list[int]] = {}
    out: list[BatchRow] = []
    seen: dict[str, int] = {}
    for index, row in enumerate(rows):
        agent, problem = agent_of(
            row, known=lambda name: name in registered, default=default_agent, source=SOURCE_COLUMN
        )
        if problem is not None:
            problems.setdefault(problem, []).append(index)
            continue
        try:
            json.dumps(row, allow_nan=True)
        except (TypeError, ValueError) as exc:
            raise BatchDataError(
                f"row {index} cannot be sent as JSON ({exc}): tasks hold JSON values only "
                "(str, numbers, bools, lists, dicts); convert tensors with .tolist()"
            ) from None
        has_id = any(row.get(k) not in (None, "") for k in ("task_id", "id"))
        task_id = task_id_of(row, index) if has_id else f"row{index}"
        if task_id in seen:
            raise BatchDataError(
                f"rows {seen[task_id]} and {index} share task id {task_id!r}: give each row a "
                "distinct task_id/id (if your framework already repeated each prompt n times, pass "
                "each prompt once and set group_size=n)"
            )
        seen[task_id] = index
        out.append(BatchRow(index=index, agent=str(agent), task_id=task_id, task=row))
    if problems:
        raise BatchDataError(_describe(problems, sorted(registered)))
    return out


def _describe(problems: dict[RoutingProblem, list[int]], registered: list[str]) -> str:
    lines = []
    for problem, indices in problems.items():
        if problem.kind is Unrouted.NOTHING_NAMES_ONE:
            lines.append(
                f"rows {_names(indices)} name no agent and {len(registered)} agents are registered "
                f"({', '.join(registered)}): add an agent_name column, or pass agent=NAME to "
                "initialize_batch_processing (or default_agent= to the orchestrator)"
            )
        elif problem.kind is Unrouted.UNKNOWN_AGENT:
            lines.append(
                f"rows {_names(indices)} ask for agent {problem.value!r}, which is not registered "
                f"(registered: {', '.join(registered)}): register it with register_agent_type "
                "or fix the agent_name column"
            )
        else:
            lines.append(
                f"rows {_names(indices)} have data_source {problem.value!r}, which is not a "
                f"registered agent (registered: {', '.join(registered)}), and there is no default "
                "agent: add an agent_name column or pass agent=NAME"
            )
    return "; ".join(lines)


def batch_id_for(
    run: str, sequence: int, rows: Sequence[BatchRow], group_size: int, is_train: bool
) -> str:
    """``b<sequence>-<digest>``: a new id for every batch of this orchestrator's run, stable
    for the same (run, position, content), so a restarted trainer re-submitting its step adds
    nothing."""
    blob = json.dumps(
        [run, sequence, group_size, is_train, [(r.agent, r.task_id, r.task) for r in rows]],
        sort_keys=True,
        separators=(",", ":"),
        default=str,
    ).encode()
    return f"b{sequence:06d}-{hashlib.sha256(blob).hexdigest()[:12]}"


def expand(
    rows: Sequence[BatchRow],
    *,
    run: str,
    batch_id: str,
    **options: Any,
) -> list[Job]:
    """``group_size`` jobs per row (``producers.expand_rows``; ``options``: ``JobOptions``'
    fields), each remembering its row."""
    task_rows = [TaskRow(r.agent, r.task_id, r.task, {"row": r.index}) for r in rows]
    try:
        return expand_rows(task_rows, run=run, batch_id=batch_id, options=JobOptions(**options))
    except SchemaError as exc:
        raise BatchDataError(str(exc)) from None
