"""``agentarium trajectories export``: a run's trajectories as an SFT dataset (JSONL or Parquet).

One record per trajectory (or per call with ``--multi-turn per-call``): the chat ``messages``
(the last call's conversation, final reply included), and the token arrays a trainer needs
without re-tokenising: ``input_ids`` (prompt then response), ``loss_mask`` (1 on tokens the
model generated, 0 on the prompt, tool results and observations) and ``logprobs``; plus ids,
status, reward and metrics. Rows are built exactly as ``generate_training_batch`` builds them
(``trainer.rows_of``), unpadded. Parquet needs ``pyarrow``. There ``messages`` is a list of
structs, the conversational shape TRL's SFTTrainer and ``datasets`` load as they are:
``role`` and ``content`` always, plus ``reasoning_content``, ``tool_calls`` (``id``, ``type``,
``function`` with ``name`` and ``arguments``, a JSON string as OpenAI sends it),
``tool_call_id`` and ``name`` only when some message of the export has them, so a chat
without tools has no null-filled extra keys for a chat template to trip on. Other message
keys are kept by the JSON lines export only. ``metrics`` and ``task`` are JSON text there.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from agentarium.schemas import Trajectory
from agentarium.trainer import rows_of

FORMATS = ("jsonl", "parquet")


def records(
    trajectories: list[Trajectory], *, multi_turn: str = "concat", min_reward: float | None = None
) -> Iterator[dict[str, Any]]:
    """Export records; trajectories without token ids keep their messages, with empty arrays."""
    for traj in trajectories:
        if min_reward is not None and (traj.reward is None or traj.reward < min_reward):
            continue
        base = {
            "job_id": traj.job_id,
            "task_id": traj.task_id,
            "group_id": traj.group_id,
            "agent": traj.agent,
            "run": traj.run,
            "status": traj.status,
            "reward": traj.reward,
            "metrics": dict(traj.metrics),
            "task": traj.task,
        }
        rows, how = rows_of(traj, multi_turn) if traj.calls else ([], "empty")
        if not rows:
            last = traj.calls[-1] if traj.calls else None
            yield {
                **base,
                "call_index": -1,
                "messages": (last.messages if last else None) or [],
                "input_ids": [],
                "loss_mask": [],
                "logprobs": [],
                "prompt_length": 0,
            }
            continue
        for row in rows:
            call = traj.calls[row.call_index] if row.call_index >= 0 else traj.calls[-1]
            yield {
                **base,
                "call_index": row.call_index,
                "messages": call.messages or [],
                "input_ids": row.prompt_ids + row.response_ids,
                "loss_mask": [0] * len(row.prompt_ids) + row.response_mask,
                "logprobs": [0.0] * len(row.prompt_ids) + row.response_logprobs,
                "prompt_length": len(row.prompt_ids),
            }


PARQUET_NEEDS = (
    "--format parquet needs pyarrow: pip install 'agentarium[parquet]' (or use --format jsonl)"
)


def write_jsonl(rows: Iterator[dict[str, Any]], path: Path | None) -> int:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)  # as `plot` does
    out = open(path, "w") if path else sys.stdout  # noqa: SIM115 - closed below unless stdout
    n = 0
    try:
        for row in rows:
            out.write(json.dumps(row) + "\n")
            n += 1
    finally:
        if path:
            out.close()
    return n


def write_parquet(rows: Iterator[dict[str, Any]], path: Path) -> int:
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ValueError(PARQUET_NEEDS) from None
    materialized = list(rows)
    columns: dict[str, list[Any]] = {
        name: []
        for name in (
            "job_id",
            "task_id",
            "group_id",
            "agent",
            "run",
            "status",
            "reward",
            "call_index",
            "prompt_length",
            "messages",
            "metrics",
            "task",
            "input_ids",
            "loss_mask",
            "logprobs",
        )
    }
    message_type, to_struct = _message_struct(pa, [r["messages"] for r in materialized])
    for row in materialized:
        for name in columns:
            value = row[name]
            if name == "messages":
                value = [to_struct(m) for m in value]
            elif name in ("metrics", "task"):
                value = json.dumps(value)
            columns[name].append(value)
    schema = pa.schema(
        [
            ("job_id", pa.string()),
            ("task_id", pa.string()),
            ("group_id", pa.string()),
            ("agent", pa.string()),
            ("run", pa.string()),
            ("status", pa.string()),
            ("reward", pa.float64()),
            ("call_index", pa.int32()),
            ("prompt_length", pa.int32()),
            ("messages", pa.list_(message_type)),
            ("metrics", pa.string()),
            ("task", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("logprobs", pa.list_(pa.float32())),
        ]
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns, schema=schema), path)
    return len(materialized)


OPTIONAL_MESSAGE_FIELDS = ("reasoning_content", "tool_calls", "tool_call_id", "name")


def _message_struct(pa: Any, conversations: list[list[dict]]) -> tuple[Any, Any]:
    """The struct type of this export's messages, and a function making one message fit it."""
    present = {
        key
        for messages in conversations
        for message in messages
        for key in OPTIONAL_MESSAGE_FIELDS
        if message.get(key) not in (None, [], "")
    }
    call = pa.struct(
        [
            ("id", pa.string()),
            ("type", pa.string()),
            ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
        ]
    )
    kinds = {
        "reasoning_content": pa.string(),
        "tool_calls": pa.list_(call),
        "tool_call_id": pa.string(),
        "name": pa.string(),
    }
    fields = [("role", pa.string()), ("content", pa.string())]
    fields += [(key, kinds[key]) for key in OPTIONAL_MESSAGE_FIELDS if key in present]

    def to_struct(message: dict) -> dict:
        out: dict[str, Any] = {
            "role": str(message.get("role", "")),
            "content": _text(message.get("content")),
        }
        for key in OPTIONAL_MESSAGE_FIELDS:
            if key not in present:
                continue
            value = message.get(key)
            if key == "tool_calls":
                out[key] = [_tool_call(c) for c in value] if value else None
            else:
                out[key] = _text(value)
        return out

    return pa.struct(fields), to_struct


def _text(value: Any) -> str | None:
    # content may be a list of parts (multimodal); a string column keeps it as JSON text
    return value if value is None or isinstance(value, str) else json.dumps(value)


def _tool_call(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    return {
        "id": call.get("id"),
        "type": call.get("type", "function"),
        "function": {
            "name": function.get("name"),
            "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
        },
    }


async def export_run(
    js: Any,
    topology: Any,
    *,
    run: str,
    agent: str = "*",
    fmt: str = "jsonl",
    out: Path | None = None,
    status: str | None = "ok",
    multi_turn: str = "concat",
    min_reward: float | None = None,
) -> int:
    """Read the run's trajectories and write them; returns the number of records."""
    from agentarium.producers import TrajectoryReader

    if fmt not in FORMATS:
        raise ValueError(f"--format must be one of {FORMATS}, got {fmt!r}")
    if fmt == "parquet" and out is None:
        raise ValueError("--format parquet writes a file: pass --out PATH")
    trajectories = await TrajectoryReader(js, topology).read(run, agent, status=status)
    rows = records(trajectories, multi_turn=multi_turn, min_reward=min_reward)
    if fmt == "parquet":
        assert out is not None, "checked above: parquet needs --out"
        return write_parquet(rows, out)
    return write_jsonl(rows, out)
