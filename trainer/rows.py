"""Trajectories -> token rows, and the rules every consumer of rows shares. Torch-free.

The one implementation behind the trainer's batches (trainer/batch.py), the orchestrator's verl
batches (agentarium/orchestrator/tensorize.py) and SFT export (agentarium/evaluation/export.py).
It imports numpy and schemas only, so ``import agentarium.trainer`` loads neither torch nor transformers.

A trajectory becomes rows in one of two modes (``MULTI_TURN``):

- ``concat`` (default): when every call's prompt starts with the previous call's prompt and
  response, token for token, the whole rollout is one row: the first call's prompt, then
  everything after it (the last call's prompt and response). Only the tokens the model
  generated carry loss (``response_mask`` 1); tool results, observations and re-rendered chat
  markup between turns sit in the response with mask 0. A trajectory whose calls do not chain
  exactly (a chat template that re-renders history differently, a truncated reply the template
  closes) is a prefix mismatch and falls back to ``per-call``.
- ``per-call``: one row per LLM call (its prompt and response).

Calls without token ids (OpenAI-compatible backends) or without generated tokens give no row.

Cross-sampled calls (``LLMCall.policy`` false: another model generated them) are context, like
tool results: their response tokens get ``response_mask`` 0 in both modes (in ``concat`` they
sit in the response between the policy's turns; in ``per-call`` their row has no loss token),
so no gradient and no importance ratio is ever taken on a token the policy did not sample. A
trajectory whose calls are all cross-sampled is ``cross_only``: its rows carry no loss token.

Also here, so that each rule lives in one place:

- ``refusal``: policy calls sampled with top_p < 1, top_k > 0 or greedily have log-probs no
  trainer can reproduce; they are refused from training, as are calls that would crash a step
  or make its loss NaN (token ids outside the vocabulary, non-finite log-probs or sampling).
- ``grpo_advantages``: GRPO's group-relative advantage, in float64 from the rewards on. A flat
  group (all rewards equal, or std 0) gives 0 for every member whatever eps is.
- ``pad_token_id``: the pad id of a model or tokenizer (its pad token, else its first eos).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from agentarium.schemas import LLMCall, Trajectory

MULTI_TURN = ("concat", "per-call")
# How rows_of built a trajectory's rows.
HOW = ("single", "concat", "per-call", "mismatch", "no_token_ids", "empty", "cross_only")


@dataclass(frozen=True)
class TokenRow:
    """One unpadded sequence: a prompt, then a response whose lists align on token positions.

    ``response_mask`` is 1 on tokens the policy generated, 0 on observations between turns
    and on tokens another model generated (cross-sampled calls);
    ``response_logprobs`` and ``response_temperature`` hold the engine's log-prob and the
    sampling temperature of each generated token (0.0 and 1.0 elsewhere);
    ``response_versions`` the weights that generated each of the policy's tokens (its call's
    ``LLMCall.token_versions``: the version string as the engine reported it), "" elsewhere.
    ``call_index`` is the call's index in ``trajectory.calls``, -1 for a concatenated row.
    """

    prompt_ids: list[int]
    response_ids: list[int]
    response_mask: list[int]
    response_logprobs: list[float]
    response_temperature: list[float]
    call_index: int = -1
    response_versions: list[str] = field(default_factory=list)

    @property
    def input_ids(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def loss_mask(self) -> list[int]:
        """Over input_ids: 1 on generated tokens."""
        return [0] * len(self.prompt_ids) + self.response_mask

    @property
    def old_logprobs(self) -> list[float]:
        """Over input_ids: the engine's log-prob of generated tokens, 0.0 elsewhere."""
        return [0.0] * len(self.prompt_ids) + self.response_logprobs

    @property
    def temperature(self) -> list[float]:
        """Over input_ids: the sampling temperature of generated tokens, 1.0 elsewhere."""
        return [1.0] * len(self.prompt_ids) + self.response_temperature

    @property
    def temperatures(self) -> set[float]:
        """The sampling temperatures of this row's generated tokens."""
        return {t for t, m in zip(self.response_temperature, self.response_mask, strict=True) if m}


def rows_of(trajectory: Trajectory, multi_turn: str = "concat") -> tuple[list[TokenRow], str]:
    """Rows of one trajectory and how they were built (one of ``HOW``): ``single`` (one call),
    ``concat``, ``per-call``, ``mismatch`` (concat refused, per-call used), ``no_token_ids``
    (calls without token ids only), ``empty`` (no generated token) or ``cross_only`` (every
    call cross-sampled: rows without a loss token)."""
    assert multi_turn in MULTI_TURN, f"multi_turn must be one of {MULTI_TURN}, got {multi_turn!r}"
    calls = [(i, c) for i, c in enumerate(trajectory.calls) if c.response_ids and c.prompt_ids]
    if not calls:
        untraced = any(not c.prompt_ids for c in trajectory.calls)
        return [], "no_token_ids" if untraced else "empty"
    rows, how = _rows(calls, multi_turn)
    if not any(c.policy for _, c in calls):
        how = "cross_only"
    return rows, how


def _rows(calls: list[tuple[int, LLMCall]], multi_turn: str) -> tuple[list[TokenRow], str]:
    if len(calls) == 1:
        return [_single(*calls[0])], "single"
    if multi_turn == "concat":
        row = _concatenated([c for _, c in calls])
        if row is not None:
            return [row], "concat"
        return [_single(i, c) for i, c in calls], "mismatch"
    return [_single(i, c) for i, c in calls], "per-call"


def _single(index: int, call: LLMCall) -> TokenRow:
    n = len(call.response_ids)
    if not call.policy:  # another model's reply: context only
        return TokenRow(
            list(call.prompt_ids),
            list(call.response_ids),
            [0] * n,
            [0.0] * n,
            [1.0] * n,
            index,
            [""] * n,
        )
    return TokenRow(
        list(call.prompt_ids),
        list(call.response_ids),
        [1] * n,
        [float(x) for x in call.response_logprobs],
        [float(call.temperature)] * n,
        index,
        call.token_versions(),
    )


def _concatenated(calls: list[LLMCall]) -> TokenRow | None:
    """One row for calls whose prompts extend each other exactly, else None."""
    for prev, nxt in zip(calls, calls[1:], strict=False):
        seen = list(prev.prompt_ids) + list(prev.response_ids)
        if list(nxt.prompt_ids[: len(seen)]) != seen:
            return None
    start = len(calls[0].prompt_ids)
    response = (list(calls[-1].prompt_ids) + list(calls[-1].response_ids))[start:]
    mask = [0] * len(response)
    logprobs = [0.0] * len(response)
    temperature = [1.0] * len(response)
    versions = [""] * len(response)
    for call in calls:
        if not call.policy:  # another model's reply stays in the row as context, mask 0
            continue
        offset = len(call.prompt_ids) - start
        n = len(call.response_ids)
        mask[offset : offset + n] = [1] * n
        logprobs[offset : offset + n] = [float(x) for x in call.response_logprobs]
        temperature[offset : offset + n] = [float(call.temperature)] * n
        versions[offset : offset + n] = call.token_versions()
    return TokenRow(list(calls[0].prompt_ids), response, mask, logprobs, temperature, -1, versions)


def refusal(trajectory: Trajectory, vocab_size: int | None = None) -> str | None:
    """Why this trajectory's policy calls cannot be trained on, or None when they can
    (cross-sampled calls are context: their log-probs are never used). Also refused: data
    that would crash a step or turn its loss into NaN (a token id outside the model's
    vocabulary of ``vocab_size``, when known; a non-finite log-prob or sampling setting)."""
    for index, call in enumerate(trajectory.calls):
        reason = call_refusal(call) if call.policy else None
        if reason:
            return f"call {index} was sampled with {reason}: its log-probs cannot be reproduced"
        reason = _unusable(call, vocab_size)
        if reason:
            return f"call {index} {reason}"
    return None


def _unusable(call: LLMCall, vocab_size: int | None) -> str | None:
    if call.policy and not (np.isfinite(call.temperature) and np.isfinite(call.top_p)):
        return f"was sampled with temperature={call.temperature}, top_p={call.top_p}: not finite"
    if call.policy and not np.isfinite(np.asarray(call.response_logprobs, np.float64)).all():
        return "holds a log-prob that is not a finite number"
    for name, ids in (("prompt_ids", call.prompt_ids), ("response_ids", call.response_ids)):
        if not len(ids):
            continue
        tokens = np.asarray(ids, np.int64)
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or (vocab_size is not None and high >= vocab_size):
            bad = low if low < 0 else high
            return f"holds token id {bad} in {name}, outside the model's vocabulary [0, {vocab_size or 'V'})"
    return None


def call_refusal(call: LLMCall) -> str | None:
    """top_p < 1, top_k > 0 and greedy sampling: log-probs no trainer can reproduce."""
    if not call.top_p >= 1.0:  # NaN too
        return f"top_p={call.top_p} (< 1)"
    if call.top_k > 0:
        return f"top_k={call.top_k} (> 0)"
    if call.temperature < 1e-6:
        return "temperature 0 (greedy)"
    return None


def grpo_advantages(
    rewards: Sequence[float] | np.ndarray, *, std_norm: bool = True, eps: float = 1e-6
) -> list[float]:
    """GRPO advantages of one group's rewards, each member once, in float64:
    (r - mean) / (std + eps), std the unbiased sample std (Bessel; as TRL and verl), or
    r - mean without std normalisation (Dr. GRPO).

    A flat group (every reward equal, or a std of 0) gives 0 for every member whatever eps is:
    its mean may differ from the rewards by a rounding error, which divided by a std of the
    same size (or by eps = 0) would be noise or NaN.
    """
    r = np.asarray(rewards, dtype=np.float64)
    assert r.ndim == 1 and r.size >= 1, "rewards must be a non-empty 1-D sequence"
    if r.size < 2 or bool(np.all(r == r[0])):
        return [0.0] * int(r.size)
    centred = r - r.mean()
    if not std_norm:
        return centred.tolist()
    std = float(r.std(ddof=1))
    if not std > 0:
        return [0.0] * int(r.size)
    return (centred / (std + eps)).tolist()


def pad_token_id(pad_id: int | None, eos_ids: int | Sequence[int] | None) -> int:
    """The pad id: the pad token's id when there is one, else the first eos id, else 0."""
    if pad_id is not None:
        return int(pad_id)
    if isinstance(eos_ids, int):
        return eos_ids
    if eos_ids:
        return int(eos_ids[0])
    return 0
