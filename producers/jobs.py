"""Expanding tasks into jobs: one job per (task, sample), with deterministic ids.

Ids are digests, never random: the same tasks submitted twice give the same batch id and
the same job ids, and the broker's dedup on ``Nats-Msg-Id`` turns the second submission
into a no-op. A GRPO group is the G samples of one task; they share a ``group_id``.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, NamedTuple

from agentarium.schemas import (
    DEFAULT_DEADLINE_S,
    Job,
    Sampling,
    SchemaError,
    check_name,
    check_settings,
    section,
    setting,
)

BATCH_ID_CHARS = 16
JOB_ID_CHARS = 32


def _digest(*parts: Any, chars: int) -> str:
    # A JSON list is unambiguous where "a" + "bc" and "ab" + "c" would collide.
    blob = json.dumps(parts, separators=(",", ":"), ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()[:chars]


def canonical_json(tasks: Sequence[Mapping[str, Any]]) -> str:
    """Key order and whitespace do not change a batch's identity."""
    try:
        return json.dumps(
            list(tasks), sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
        )
    except (TypeError, ValueError) as exc:
        raise SchemaError(
            f"tasks must be JSON objects (no NaN, no non-JSON values): {exc}", field="task"
        ) from exc


def default_batch_id(
    agent: str | Sequence[str],
    run: str,
    group_size: int,
    is_train: bool,
    tasks: Sequence[Mapping[str, Any]],
) -> str:
    return _digest(
        "batch", agent, run, group_size, is_train, canonical_json(tasks), chars=BATCH_ID_CHARS
    )


def job_id_for(run: str, batch_id: str, task_id: str, sample_index: int) -> str:
    return _digest("job", run, batch_id, task_id, sample_index, chars=JOB_ID_CHARS)


def group_id_for(run: str, batch_id: str, task_id: str) -> str:
    return _digest("group", run, batch_id, task_id, chars=JOB_ID_CHARS)


def task_id_of(task: Mapping[str, Any], index: int) -> str:
    """``task_id``, else ``id`` (stringified), else the row index as ``t<index>``."""
    for key in ("task_id", "id"):
        value = task.get(key)
        if value is not None and value != "":
            return str(value)
    return f"t{index}"


def _task_ids(tasks: Sequence[Mapping[str, Any]]) -> list[str]:
    seen: dict[str, int] = {}
    ids = []
    for index, task in enumerate(tasks):
        if not isinstance(task, Mapping):
            raise SchemaError(
                f"tasks[{index}] must be a JSON object, got {type(task).__name__}",
                field=f"tasks[{index}]",
            )
        task_id = task_id_of(task, index)
        if task_id in seen:
            err = SchemaError(
                f"duplicate task id {task_id!r}: tasks[{seen[task_id]}] and tasks[{index}] "
                "(give each task a distinct task_id/id, or submit them in separate batches)",
                field=f"tasks[{index}].task_id",
            )
            err.rows = (seen[task_id], index)  # type: ignore[attr-defined]  # the CLI maps them to lines
            raise err
        seen[task_id] = index
        ids.append(task_id)
    return ids


class TaskRow(NamedTuple):
    """One task to expand: its agent, id, payload, and metadata of its own (merged over the
    batch's)."""

    agent: str
    task_id: str
    task: Mapping[str, Any]
    metadata: Mapping[str, Any] = {}


def check_expansion(group_size: Any, deadline_s: Any) -> None:
    """The group size and deadline every job factory accepts; SchemaError names the field."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise SchemaError(
            f"group_size must be an integer >= 1, got {group_size!r}", field="group_size"
        )
    if not (
        isinstance(deadline_s, (int, float))
        and not isinstance(deadline_s, bool)
        and math.isfinite(deadline_s)
        and deadline_s > 0
    ):
        raise SchemaError(
            f"deadline_s must be a positive number of seconds, got {deadline_s!r}",
            field="deadline_s",
        )


@dataclass(frozen=True, kw_only=True)
class JobOptions:
    """What the jobs of one batch share beside their tasks, declared once with their defaults:
    ``make_job`` and ``expand_rows`` take the value, ``expand_tasks`` and
    ``TaskProducer.submit`` its fields as keywords. Checked when made (SchemaError names the
    field). Its fields are settings (``schemas.setting``), ``Sampling`` a section: ``agentarium
    produce``'s job flags and ``--config`` keys are derived from them."""

    group_size: int = setting(
        1, ge=1, metavar="G", help="samples per task: G jobs sharing a group_id, for GRPO"
    )
    is_train: bool = setting(
        True,
        flag="--eval",
        negate=True,
        help="evaluation jobs (is_train=false): never trained on",
    )
    sampling: Sampling = section(Sampling)  # None (passed through by callers): Sampling()
    deadline_s: float = setting(DEFAULT_DEADLINE_S, gt=0, help="seconds a rollout may take")
    metadata: Mapping[str, Any] | None = None  # copied to every job, under a row's own

    def __post_init__(self) -> None:
        if self.sampling is None:
            object.__setattr__(self, "sampling", Sampling())
        check_expansion(self.group_size, self.deadline_s)  # a library caller's SchemaError
        check_settings(self)  # every other declared bound (group_size's and deadline's are above)
        if self.metadata is not None and not isinstance(self.metadata, Mapping):
            raise SchemaError("metadata must be a JSON object", field="metadata")


def make_job(
    *,
    agent: str,
    task: Mapping[str, Any],
    task_id: str,
    run: str,
    batch_id: str,
    sample_index: int,
    options: JobOptions = JobOptions(),
    group_batch_id: str | None = None,
    created_at: float | None = None,
) -> Job:
    """The one job factory: ids derived from (run, batch, task, sample), never random.

    ``group_batch_id`` (default ``batch_id``) names the batch the group belongs to, so a job
    re-run in a later batch (an eval retry) gets a new job id but stays in its group.
    """
    return Job(
        job_id=job_id_for(run, batch_id, task_id, sample_index),
        agent=agent,
        task=dict(task),
        task_id=task_id,
        group_id=group_id_for(run, group_batch_id or batch_id, task_id),
        sample_index=sample_index,
        group_size=options.group_size,
        run=run,
        batch_id=batch_id,
        is_train=options.is_train,
        sampling=options.sampling,
        deadline_s=float(options.deadline_s),
        metadata=dict(options.metadata or {}),
        created_at=time.time() if created_at is None else created_at,
    )


def expand_rows(
    rows: Sequence[TaskRow], *, run: str, batch_id: str, options: JobOptions = JobOptions()
) -> list[Job]:
    """``options.group_size`` jobs per row, the samples of one row next to each other."""
    created_at = time.time()  # not part of any id: ids stay deterministic
    return [
        make_job(
            agent=row.agent,
            task=row.task,
            task_id=row.task_id,
            run=run,
            batch_id=batch_id,
            sample_index=sample_index,
            options=_with_row_metadata(options, row),
            created_at=created_at,
        )
        for row in rows
        for sample_index in range(options.group_size)
    ]


def _with_row_metadata(options: JobOptions, row: TaskRow) -> JobOptions:
    if not row.metadata:
        return options
    return replace(options, metadata={**(options.metadata or {}), **row.metadata})


def expand_tasks(
    agent: str | Sequence[str],
    tasks: Sequence[Mapping[str, Any]],
    *,
    run: str = "default",
    batch_id: str | None = None,
    **options: Any,
) -> tuple[str, list[Job]]:
    """Expand ``tasks`` into ``len(tasks) * group_size`` jobs; returns ``(batch_id, jobs)``.
    ``agent`` names the agent of every task, or is a list with one agent per task (tasks
    routed by a column, ``producers.agent_of``); ``options``: ``JobOptions``' fields
    (``group_size``, ``is_train``, ``sampling``, ``deadline_s``, ``metadata``). Every name is
    validated here, before anything reaches the broker."""
    agents = [agent] * len(tasks) if isinstance(agent, str) else list(agent)
    if len(agents) != len(tasks):
        raise SchemaError(
            f"{len(agents)} agents for {len(tasks)} tasks: pass one agent, or one per task",
            field="agent",
        )
    for name in sorted(set(agents)):
        check_name(name, "agent")
    check_name(run, "run")
    shared = JobOptions(**options)
    task_ids = _task_ids(tasks)
    if batch_id is None:
        # one agent keeps the ids it always had; routed tasks also digest who gets each task
        who: str | list[str] = agent if isinstance(agent, str) else agents
        batch_id = default_batch_id(who, run, shared.group_size, shared.is_train, tasks)
    else:
        check_name(batch_id, "batch_id")
    rows = [
        TaskRow(name, task_id, task)
        for name, task, task_id in zip(agents, tasks, task_ids, strict=True)
    ]
    return batch_id, expand_rows(rows, run=run, batch_id=batch_id, options=shared)
