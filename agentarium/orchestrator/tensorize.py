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
  advantages        (B, R)    the trainer's GRPO advantage of the row's trajectory, on its
                              response_mask (0 elsewhere); see "Advantages" below
Non-tensor columns (numpy object arrays): uid (the GRPO group id), job_id, status, agent_name,
task_id, call_index (-1 for a concatenated row). meta_info: multi_turn, pad_token_id, the max
lengths, multi_row_trajectories, refused ({job_id: reason}) and rollout_temperature.

Advantages. verl's GRPO estimator (``compute_grpo_outcome_advantage``) groups *rows* by
``uid``, so a trajectory split into k rows (per-call mode, or a prefix mismatch) would count k
times in its group's mean and std; the trainer counts each trajectory once. The batch
therefore ships ``advantages``, computed with the trainer's ``grpo_advantages`` over each
group's ok trajectories that have rows, each once (float64 until stored). When
``meta_info["multi_row_trajectories"]`` is 0 (one row per trajectory) verl's ``grpo``
estimator gives the same numbers, except for a group of one (verl: its raw score; here 0).
When it is not 0, verl's advantage step must be skipped for the batch: verl 0.9.1 has no
``algorithm.adv_estimator`` that keeps a batch's advantages (every estimator, ``grpo``
included, overwrites ``advantages`` and ``returns`` in ``compute_advantage``, which
``RayPPOTrainer.fit`` and the v1 trainer call every step), so the fit loop that calls the
orchestrator must not call ``compute_advantage`` for it and set ``returns`` = ``advantages``.

Failures. Trajectories with status error/timeout are infrastructure failures: left out by
default, and counted. ``include_failed`` keeps them as placeholder rows, for callers that need
one row per failed rollout: response_mask, scores and advantages all 0, and a ``uid`` of their
own (``<group_id>:<status>:<job_id>``), so verl's GRPO sees each as a group of one with score 0
(advantage 0) and the real group's mean and std never include them.

Sampling. Calls the trainer refuses (``trainer.refusal``: top_p < 1, top_k > 0, greedy; their
log-probs cannot be reproduced) are left out with their whole trajectory, as the trainer does:
counted in ``batch/refused``, reasons in ``meta_info["refused"]``, out of group statistics.
verl recomputes log-probs at one temperature, ``actor_rollout_ref.rollout.temperature`` (its
trainer writes it into ``meta_info["temperature"]`` before each actor call; a batch column of
that name would collide with it in ``DataProto.to_tensordict``), so the temperature the rows
were sampled at is ``meta_info["rollout_temperature"]``, and a batch whose model tokens were
sampled at several temperatures is refused with a ValueError naming the jobs at each.
Calls without token ids (OpenAI-compatible backends) cannot be trained on: left out, counted.
Cross-sampled calls (``LLMCall.policy`` false, another model's replies) are context:
``response_mask`` 0 on their tokens; a trajectory with no policy call keeps its rows (all mask
0, so its reward still counts in its group's statistics) and is counted in ``batch/cross_only``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from agentarium.schemas import Trajectory
from agentarium.trainer import MULTI_TURN, TokenRow, grpo_advantages, refusal, rows_of

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
    std_norm: bool = True,
    adv_eps: float = 1e-6,
) -> tuple[TrainingBatch, dict[str, float]]:
    """Pad ``trajectories`` into a TrainingBatch; returns it and the batch's counting metrics.

    ``std_norm`` and ``adv_eps`` shape the ``advantages`` tensor as verl's
    ``algorithm.norm_adv_by_std_in_grpo`` and GRPO epsilon (1e-6) do. Raises ValueError when
    the trainable rows were sampled at different temperatures (see the module docstring).
    """
    import torch

    assert max_prompt_length > 0 and max_response_length > 0, "max lengths must be > 0"
    P, R = max_prompt_length, max_response_length
    counts: Counter[str] = Counter()
    rows: list[tuple[Trajectory, TokenRow]] = []
    refused: dict[str, str] = {}
    for traj in trajectories:
        if traj.status != "ok":
            counts[f"dropped_{traj.status}"] += 1
            if include_failed:
                first = next((c for c in traj.calls if c.prompt_ids), None)
                prompt = list(first.prompt_ids) if first else [pad_token_id]
                rows.append((traj, TokenRow(prompt, [], [], [], [], -1)))
            continue
        reason = refusal(traj)
        if reason is not None:
            counts["refused"] += 1
            refused[traj.job_id] = reason
            continue
        built, how = rows_of(traj, multi_turn)
        counts[how] += 1
        counts["multi_row"] += len(built) > 1
        rows.extend((traj, row) for row in built)
    temperature = _one_temperature(rows)
    advantage = _trajectory_advantages(rows, std_norm=std_norm, eps=adv_eps)

    # Rows are filled in numpy (a slice assignment there costs a microsecond; a torch one,
    # with its tensor() of a list, about ten), then handed to torch without a copy.
    B = len(rows)
    prompts_np = np.full((B, P), pad_token_id, dtype=np.int64)
    responses_np = np.full((B, R), pad_token_id, dtype=np.int64)
    prompt_attn_np = np.zeros((B, P), dtype=np.int64)
    response_attn_np = np.zeros((B, R), dtype=np.int64)
    response_mask_np = np.zeros((B, R), dtype=np.int64)
    logprobs_np = np.zeros((B, R), dtype=np.float32)
    scores_np = np.zeros((B, R), dtype=np.float32)
    advantages_np = np.zeros((B, R), dtype=np.float32)
    for i, (traj, row) in enumerate(rows):
        prompt = row.prompt_ids
        if len(prompt) > P:
            counts["truncated_prompts"] += 1
            prompt = prompt[-P:]
        if prompt:
            prompts_np[i, P - len(prompt) :] = prompt
            prompt_attn_np[i, P - len(prompt) :] = 1
        n = min(len(row.response_ids), R)
        if len(row.response_ids) > R:
            counts["truncated_responses"] += 1
            counts["truncated_model_tokens"] += sum(row.response_mask[R:])
        if n:
            responses_np[i, :n] = row.response_ids[:n]
            response_attn_np[i, :n] = 1
            response_mask_np[i, :n] = row.response_mask[:n]
            logprobs_np[i, :n] = row.response_logprobs[:n]
        if traj.status == "ok" and n:
            assert traj.reward is not None, "status ok implies a reward (Trajectory)"
            model_positions = [j for j in range(n) if row.response_mask[j]]
            scores_np[i, model_positions[-1] if model_positions else n - 1] = float(traj.reward)
            # float32 first, as torch multiplies a float32 tensor by the mask
            advantages_np[i] = np.float32(advantage[traj.job_id]) * response_mask_np[i]
    prompts = torch.from_numpy(prompts_np)
    responses = torch.from_numpy(responses_np)
    prompt_attn = torch.from_numpy(prompt_attn_np)
    response_attn = torch.from_numpy(response_attn_np)
    response_mask = torch.from_numpy(response_mask_np)
    logprobs = torch.from_numpy(logprobs_np)
    scores = torch.from_numpy(scores_np)
    advantages = torch.from_numpy(advantages_np)
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
        "advantages": advantages,  # (B, R)
    }
    tensors = {k: v.to(device) for k, v in tensors.items()}

    def column(values: list[Any]) -> np.ndarray:
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out

    non_tensors = {
        "uid": column([_uid(t) for t, _ in rows]),
        "job_id": column([t.job_id for t, _ in rows]),
        "status": column([t.status for t, _ in rows]),
        "agent_name": column([t.agent for t, _ in rows]),
        "task_id": column([t.task_id for t, _ in rows]),
        "call_index": column([r.call_index for _, r in rows]),
    }
    meta: dict[str, Any] = {
        "multi_turn": multi_turn,
        "pad_token_id": pad_token_id,
        "max_prompt_length": P,
        "max_response_length": R,
        "multi_row_trajectories": counts["multi_row"],
        "refused": refused,
    }
    if temperature is not None:
        meta["rollout_temperature"] = temperature
    metrics = {
        "batch/rows": float(B),
        "batch/trajectories": float(len(trajectories)),
        "batch/concatenated": float(counts["concat"]),
        "batch/prefix_mismatches": float(counts["mismatch"]),
        "batch/multi_row_trajectories": float(counts["multi_row"]),
        "batch/no_token_ids": float(counts["no_token_ids"]),
        "batch/empty": float(counts["empty"]),
        "batch/cross_only": float(counts["cross_only"]),
        "batch/refused": float(counts["refused"]),
        "batch/dropped_error": float(counts["dropped_error"]),
        "batch/dropped_timeout": float(counts["dropped_timeout"]),
        "batch/truncated_prompts": float(counts["truncated_prompts"]),
        "batch/truncated_responses": float(counts["truncated_responses"]),
        "batch/truncated_model_tokens": float(counts["truncated_model_tokens"]),
        "batch/model_tokens": float(response_mask.sum()),
    }
    return TrainingBatch(tensors, non_tensors, meta), metrics


def _uid(traj: Trajectory) -> str:
    """The GRPO group key: the group id; a failed trajectory's row is a group of its own."""
    if traj.status == "ok":
        return traj.group_id
    return f"{traj.group_id}:{traj.status}:{traj.job_id}"


def _trajectory_advantages(
    rows: list[tuple[Trajectory, TokenRow]], *, std_norm: bool, eps: float
) -> dict[str, float]:
    """job id -> the trainer's GRPO advantage (``trainer.grpo_advantages``), each trajectory
    counted once in its group however many rows it has; groups are the ok trajectories with
    rows."""
    groups: dict[str, dict[str, float]] = {}
    for traj, _ in rows:
        if traj.status == "ok":
            assert traj.reward is not None, "status ok implies a reward (Trajectory)"
            groups.setdefault(traj.group_id, {})[traj.job_id] = float(traj.reward)
    out: dict[str, float] = {}
    for members in groups.values():
        values = grpo_advantages(list(members.values()), std_norm=std_norm, eps=eps)
        out.update(zip(members, values, strict=True))
    return out


def _one_temperature(rows: list[tuple[Trajectory, TokenRow]]) -> float | None:
    """The one temperature the trainable rows were sampled at (None without any); ValueError
    naming the jobs at each when there are several."""
    jobs: dict[float, dict[str, None]] = {}
    for traj, row in rows:
        if traj.status == "ok":
            for t in row.temperatures:
                jobs.setdefault(t, {})[traj.job_id] = None
    if len(jobs) > 1:
        at = "; ".join(
            f"T={t}: job{'s' if len(j) > 1 else ''} {_names(list(j))}"
            for t, j in sorted(jobs.items())
        )
        raise ValueError(
            "this batch's model tokens were sampled at different temperatures, but verl "
            "recomputes every row's log-probs at one temperature (actor_rollout_ref.rollout."
            f"temperature): {at}. Sample every agent of a training batch at one temperature."
        )
    return next(iter(jobs), None)


def _names(jobs: list[str], limit: int = 5) -> str:
    shown = ", ".join(jobs[:limit])
    return shown if len(jobs) <= limit else f"{shown} and {len(jobs) - limit} more"
