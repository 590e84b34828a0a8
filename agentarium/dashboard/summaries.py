"""What the page may see of one message: short rows, every free text capped.

Dead letters carry user payloads (a task, a traceback): only a preview of ``preview`` characters
of the error and of the job's task leaves the dashboard, never the job's metadata or the raw
bytes of an undecodable payload. Trajectories are reduced to their outcome; token arrays and
chat messages stay on the broker.
"""

from __future__ import annotations

import json
from typing import Any

from agentarium.schemas import DeadLetter, SchemaError, Trajectory, versions_label


def preview(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: max(0, limit - 1)] + "…"


def dead_letter_row(letter: DeadLetter, *, agent: str, seq: int, limit: int) -> dict[str, Any]:
    task = letter.job.get("task") if isinstance(letter.job, dict) else None
    return {
        "seq": seq,
        "agent": agent,
        "reason": letter.reason,
        "job_id": letter.job_id,
        "attempts": letter.attempts,
        "worker_id": letter.worker_id,
        "at": letter.at,
        "error": preview(letter.error, limit),
        "task": "" if task is None else preview(json.dumps(task, ensure_ascii=False), limit),
        "undecodable": letter.raw is not None,
    }


def undecodable_dead_letter_row(
    error: SchemaError, *, agent: str, seq: int, limit: int
) -> dict[str, Any]:
    return {
        "seq": seq,
        "agent": agent,
        "reason": "unreadable dead letter",
        "job_id": "",
        "attempts": 0,
        "worker_id": "",
        "at": 0.0,
        "error": preview(str(error), limit),
        "task": "",
        "undecodable": True,
    }


def weight_versions(trajectory: Trajectory) -> str:
    """The weights that served the rollout, every token's (``LLMCall.weight_spans`` too):
    ``default``, ``A@3``, ``A@2..A@3`` across versions of run A (``versions_label``); ``""``
    with no call."""
    return versions_label(v for call in trajectory.calls for v, _, _ in call.version_spans())


def trajectory_row(trajectory: Trajectory, *, seq: int, trace_url: str) -> dict[str, Any]:
    t = trajectory
    seconds = t.finished_at - t.started_at if t.finished_at and t.started_at else None
    return {
        "seq": seq,
        "run": t.run,
        "agent": t.agent,
        "job_id": t.job_id,
        "is_train": t.is_train,
        "status": t.status,
        "reward": t.reward,
        "weight_version": weight_versions(t),
        "calls": len(t.calls),
        "seconds": None if seconds is None else round(seconds, 3),
        "finished_at": t.finished_at,
        "trace_id": t.trace_id,
        "trace_url": trace_link(trace_url, t.trace_id),
    }


def trace_link(template: str, trace_id: str) -> str:
    """The trace viewer's URL for a trace, or "" without a template or a trace id."""
    if not template or len(trace_id) != 32:
        return ""
    try:
        int(trace_id, 16)
    except ValueError:
        return ""  # only hex goes into a URL the page will open
    return template.replace("{trace_id}", trace_id)
