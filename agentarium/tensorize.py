"""Trajectories -> the padded tensors an RL framework trains on (verl's field names and layout).

Each trajectory becomes rows in one of two modes (``trainer.rows_of``, the trainer's own):
- ``concat`` (default): when every call's prompt extends the previous call's prompt and
  response token for token, the rollout is one row: the first call's prompt, then everything
  after it; tool results and re-rendered chat markup between turns sit in the response with
  ``response_mask`` 0. Calls that do not chain fall back to per-call rows (counted).
- ``per-call``: one row per LLM call, each carrying the rollout's reward.

Layout per row, P = max_prompt_length, R = max_response_length:
  prompts           (B, P)    left-padded; a longer prompt keeps its last P tokens (counted)
  responses         (B, R)    right-padded; a longer response is cut at R (counted)
  input_ids         (B, P+R)  prompts ++ responses
  attention_mask    (B, P+R)  1 on real tokens
  position_ids      (B, P+R)  cumsum(attention_mask) - 1, clipped at 0 (verl's convention)
  response_mask     (B, R)    1 on tokens the policy generated, 0 on observations and padding
  rollout_log_probs (B, R)    the engine's log-prob of each generated token, 0 elsewhere
  token_level_scores(B, R)    the reward on the last generated token kept, 0 elsewhere
Non-tensor columns (numpy object arrays): uid (the group id), job_id, status, agent_name,
task_id, call_index (-1 for a concatenated row).

Trajectories with status error/timeout are infrastructure failures: left out by default (so
they never enter GRPO group statistics as reward 0) and counted; ``include_failed`` keeps them
as rows with an all-zero response mask and score, for callers that need a fixed row count.
Calls without token ids (OpenAI-compatible backends) cannot be trained on: left out, counted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from schemas import Trajectory
from trainer import MULTI_TURN, TokenRow, rows_of

MODES = MULTI_TURN


@dataclass
class TrainingBatch:
    """Tensors and non-tensor columns; ``batch["input_ids"]`` reads either kind."""

    tensors: dict[str, Any]
    non_tensors: dict[str, np.ndarray]
    meta_info: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        if key in self.tensors:
            return self.tensors[key]
        return self.non_tensors[key]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def keys(self) -> list[str]:
        return [*self.tensors, *self.non_tensors]

    def __len__(self) -> int:
        return len(self.non_tensors["job_id"])

    def to_dataproto(self) -> Any:
        """A verl ``DataProto`` (needs verl installed)."""
        from verl import DataProto

        return DataProto.from_dict(
            tensors=self.tensors, non_tensors=self.non_tensors, meta_info=dict(self.meta_info)
        )

    def save(self, path: str | Path) -> Path:
        """``.npz`` (numpy only, readable without torch) or ``.pt`` (torch.save)."""
        path = Path(path)
        if path.suffix == ".pt":
            import torch

            torch.save(
                {
                    "tensors": {k: v.cpu() for k, v in self.tensors.items()},
                    "non_tensors": {k: v.tolist() for k, v in self.non_tensors.items()},
                    "meta_info": self.meta_info,
                },
                path,
            )
            return path
        arrays = {f"t.{k}": v.cpu().numpy() for k, v in self.tensors.items()}
        arrays.update({f"n.{k}": np.asarray(v, dtype=str) for k, v in self.non_tensors.items()})
        np.savez(path, **arrays)
        return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def tensorize(
    trajectories: Sequence[Trajectory],
    *,
    max_prompt_length: int,
    max_response_length: int,
    pad_token_id: int,
    device: Any = "cpu",
    multi_turn: str = "concat",
    include_failed: bool = False,
) -> tuple[TrainingBatch, dict[str, float]]:
    """Pad ``trajectories`` into a TrainingBatch; returns it and the batch's counting metrics."""
    import torch

    assert max_prompt_length > 0 and max_response_length > 0, "max lengths must be > 0"
    P, R = max_prompt_length, max_response_length
    counts: Counter[str] = Counter()
    rows: list[tuple[Trajectory, TokenRow]] = []
    for traj in trajectories:
        if traj.status != "ok":
            counts[f"dropped_{traj.status}"] += 1
            if include_failed:
                first = next((c for c in traj.calls if c.prompt_ids), None)
                prompt = list(first.prompt_ids) if first else [pad_token_id]
                rows.append((traj, TokenRow(prompt, [], [], [], [], -1)))
            continue
        built, how = rows_of(traj, multi_turn)
        counts[how] += 1
        rows.extend((traj, row) for row in built)

    B = len(rows)
    prompts = torch.full((B, P), pad_token_id, dtype=torch.long)
    responses = torch.full((B, R), pad_token_id, dtype=torch.long)
    prompt_attn = torch.zeros((B, P), dtype=torch.long)
    response_attn = torch.zeros((B, R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    logprobs = torch.zeros((B, R), dtype=torch.float32)
    scores = torch.zeros((B, R), dtype=torch.float32)
    for i, (traj, row) in enumerate(rows):
        prompt = row.prompt_ids
        if len(prompt) > P:
            counts["truncated_prompts"] += 1
            prompt = prompt[-P:]
        prompts[i, P - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        prompt_attn[i, P - len(prompt) :] = 1
        n = min(len(row.response_ids), R)
        if len(row.response_ids) > R:
            counts["truncated_responses"] += 1
            counts["truncated_model_tokens"] += sum(row.response_mask[R:])
        if n:
            responses[i, :n] = torch.tensor(row.response_ids[:n], dtype=torch.long)
            response_attn[i, :n] = 1
            response_mask[i, :n] = torch.tensor(row.response_mask[:n], dtype=torch.long)
            logprobs[i, :n] = torch.tensor(row.response_logprobs[:n], dtype=torch.float32)
        if traj.status == "ok" and n:
            model_positions = [j for j in range(n) if row.response_mask[j]]
            scores[i, model_positions[-1] if model_positions else n - 1] = float(traj.reward)
    attention = torch.cat([prompt_attn, response_attn], dim=1)
    tensors = {
        "prompts": prompts,  # (B, P)
        "responses": responses,  # (B, R)
        "input_ids": torch.cat([prompts, responses], dim=1),  # (B, P+R)
        "attention_mask": attention,  # (B, P+R)
        "position_ids": torch.clip(torch.cumsum(attention, dim=1) - 1, min=0),  # (B, P+R)
        "response_mask": response_mask,  # (B, R)
        "rollout_log_probs": logprobs,  # (B, R)
        "token_level_scores": scores,  # (B, R)
    }
    tensors = {k: v.to(device) for k, v in tensors.items()}

    def column(values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    non_tensors = {
        "uid": column([t.group_id for t, _ in rows]),
        "job_id": column([t.job_id for t, _ in rows]),
        "status": column([t.status for t, _ in rows]),
        "agent_name": column([t.agent for t, _ in rows]),
        "task_id": column([t.task_id for t, _ in rows]),
        "call_index": column([r.call_index for _, r in rows]),
    }
    meta = {
        "multi_turn": multi_turn,
        "pad_token_id": pad_token_id,
        "max_prompt_length": P,
        "max_response_length": R,
    }
    metrics = {
        "batch/rows": float(B),
        "batch/trajectories": float(len(trajectories)),
        "batch/concatenated": float(counts["concat"]),
        "batch/prefix_mismatches": float(counts["mismatch"]),
        "batch/no_token_ids": float(counts["no_token_ids"]),
        "batch/empty": float(counts["empty"]),
        "batch/dropped_error": float(counts["dropped_error"]),
        "batch/dropped_timeout": float(counts["dropped_timeout"]),
        "batch/truncated_prompts": float(counts["truncated_prompts"]),
        "batch/truncated_responses": float(counts["truncated_responses"]),
        "batch/truncated_model_tokens": float(counts["truncated_model_tokens"]),
        "batch/model_tokens": float(response_mask.sum()),
    }
    return TrainingBatch(tensors, non_tensors, meta), metrics
