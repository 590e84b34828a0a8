"""GRPO's math as pure torch functions: advantages, token log-probs, the clipped loss, k3 KL,
truncated importance weights and the three loss aggregations.

The algorithm (one optimizer step on B groups of G rollouts of the same task):

    A_i      = (r_i - mean(r)) / (std(r) + eps)                      per group, std optional
    A_i      = (A_i - mean_t) / (std_t + eps)                        per task t, --task-adv-norm
    ratio_t  = exp(clamp(logp_theta(y_t) - logp_old(y_t), -20, 20))  per model token
    p_t      = -min(ratio_t A_i, clip(ratio_t, 1 - clip_low, 1 + clip_high) A_i)
    p_t      = min(p_t, -A_i c)            where A_i < 0               dual-clip, c = 3
    l_t      = p_t * w_t + kl_coef * k3_t - entropy_coef * H_t,  k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1
    loss     = aggregate(l, mask)                                    mask = model tokens only

Departures from textbook GRPO (DeepSeekMath, 2024), each on purpose:

1. logp_old is what the inference engine recorded while sampling (the behaviour policy), not a
   trainer recomputation: rollouts are asynchronous, so the ratio corrects for the policy lag
   (and for engine/trainer numerical drift) instead of being 1 on the first update.
2. One optimizer step per batch (the paper's mu = 1); fresh data does the rest.
3. Separate clip_low / clip_high (DAPO's "clip-higher"); the defaults are symmetric (0.2).
4. The default aggregation is token-mean (DAPO): every model token of the batch weighs the
   same. The paper's per-sequence mean is ``seq-mean-token-mean``; Dr. GRPO's sum over tokens
   divided by a constant is ``seq-mean-token-sum-norm``.
5. The KL term is off by default (kl_coef = 0); when on, it is the k3 estimator against the
   frozen initial model, added per token inside the aggregation as in the paper.
6. std normalisation is optional (Dr. GRPO drops it); std is the unbiased sample std
   (Bessel), as in TRL and verl.
7. Staleness is per token (each token by the version that sampled it: a call can cross a
   weight update). A trajectory with tokens older than ``max_staleness`` policy versions is
   dropped (``drop``), has those tokens masked out of the loss (``mask``), or has them trained
   by truncated importance sampling (``tis``): for those tokens the ratio is taken against the
   trainer's current policy (so it is 1 and only carries the gradient), and each is weighted
   by w_t = min(pi_current / pi_rollout, tis_clip), detached (tis_clip = 2). Its reward stays
   in its group's advantage statistics under every policy.
8. Log-probs are taken at each call's sampling temperature, log_softmax(logits / T), which is
   what SGLang and the local engine report; top_p / top_k samples are refused upstream because
   their log-probs cannot be reproduced.
9. An optional entropy bonus (entropy_coef, off by default), H_t the entropy of the policy at
   each model token: a tiny randomly initialised policy otherwise collapses onto one answer
   for every prompt, after which every group is flat and GRPO has no gradient left.
10. Infrastructure failures (status error / timeout) are kept out of group statistics, groups
   may be released short after a timeout (>= 2 ok members), and groups whose rewards are all
   equal may be filtered out (DAPO's dynamic sampling); see trainer/groups.py.
11. Dual-clip PPO (Ye et al., 2019; verl's ``clip_ratio_c``): for A < 0 the per-token loss is
   capped at -A c (c = ``dual_clip``, 3 by default, 0 / none turns it off), so a token the
   policy now likes far more than the rollout did cannot add an unbounded loss and gradient.
12. The log-ratio is clamped to [-20, 20] before exp (as verl), so one token whose log-prob
   moved by 30 nats gives a ratio of 4.9e8, not 9.7e12 (and never inf).
13. A flat group (all rewards equal, or std 0) has advantage 0 for every member whatever eps
   is (eps = 0 is allowed: no 0/0); rewards stay float64 until the advantages are computed.
14. Task advantage normalisation (``--task-adv-norm token|trajectory``, off by default), for a
   trainer of several agents (a task is an agent): after the group advantages, each task t of
   the step is standardised on its own, A_i <- (A_i - mean_t) / (std_t + eps), so a task whose
   rewards are on a larger scale, or whose groups happen to be more spread, does not dominate
   the gradient. ``token``: mean_t and std_t are weighted by each trajectory's count of
   trained tokens (the loss mask's, over all its rows), i.e. they run over the task's model
   tokens, as token-mean weighs them; ``trajectory``: every trajectory counts once. std_t is
   the population (weighted) std. Groups whose advantages are all zero (flat) stay zero and
   are left out of mean_t and std_t: they carry no signal, and shifting them by -mean_t
   would push their tokens up or down for nothing. A task with std_t = 0 gets zeros.

Shapes: B rows, T positions, V vocabulary. Functions take tensors aligned on target positions
(the caller shifts logits and ids by one).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .rows import grpo_advantages

AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
DUAL_CLIP = 3.0  # verl's clip_ratio_c
LOG_RATIO_CLAMP = 20.0  # verl clamps logp - logp_old to [-20, 20] before exp


def group_advantages(rewards: torch.Tensor, *, std_norm: bool = True, eps: float = 1e-6):
    """(G,) rewards of one group -> (G,) float64 advantages: r - mean, divided by (std + eps)
    if asked. A flat group (all rewards equal, or std 0) gives zeros whatever eps is. The math
    is ``trainer.rows.grpo_advantages`` (torch-free, shared with the orchestrator's batches)."""
    assert rewards.dim() == 1 and rewards.numel() >= 1, "rewards must be a non-empty (G,) tensor"
    values = rewards.detach().to(torch.float64).cpu().tolist()
    return torch.tensor(grpo_advantages(values, std_norm=std_norm, eps=eps), dtype=torch.float64)


def task_normalized(
    advantages: Sequence[float],
    tasks: Sequence[str],
    groups: Sequence[str],
    weights: Sequence[float],
    *,
    eps: float = 1e-6,
) -> list[float]:
    """Per-task standardisation of one step's advantages (departure 14), in float64.

    Entry i is one trajectory: its group advantage, task, group key and weight (its trained
    tokens for ``token``, 1 for ``trajectory``). Entries of a group whose advantages are all
    zero stay zero and are not counted; a task with no weight or std 0 gets zeros too.
    """
    n = len(advantages)
    assert len(tasks) == n and len(groups) == n and len(weights) == n, "one entry per trajectory"
    moving = {g for g, a in zip(groups, advantages, strict=True) if a != 0.0}
    flat_groups = set(groups) - moving
    out = [0.0] * n
    for task in dict.fromkeys(tasks):
        mine = [i for i in range(n) if tasks[i] == task and groups[i] not in flat_groups]
        total = math.fsum(float(weights[i]) for i in mine)
        if not mine or total <= 0:
            continue
        mean = math.fsum(float(weights[i]) * advantages[i] for i in mine) / total
        var = math.fsum(float(weights[i]) * (advantages[i] - mean) ** 2 for i in mine) / total
        std = math.sqrt(var)
        if std == 0.0:
            continue
        for i in mine:
            out[i] = (advantages[i] - mean) / (std + eps)
    return out


def at_least_fp32(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or as it is when wider (a float64 model, ``--dtype float64``)."""
    return t if t.dtype == torch.float64 else t.float()


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, temperature: torch.Tensor | float = 1.0
) -> torch.Tensor:
    """log softmax(logits / T) at the target ids: (B, T, V), (B, T) -> (B, T), in float32
    (float64 for a float64 model).

    ``temperature`` is a float, or a (B, T) / (B, 1) tensor (each call's sampling temperature).
    """
    logits = at_least_fp32(logits)
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.to(logits.dtype).unsqueeze(-1)  # (B, T, V)
    elif temperature != 1.0:
        logits = logits / temperature
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)


def token_entropy(logits: torch.Tensor, temperature: torch.Tensor | float = 1.0) -> torch.Tensor:
    """Entropy of the (tempered) next-token distribution: (B, T, V) -> (B, T). Differentiable
    (the entropy bonus); pass detached logits when it is only a metric."""
    logits = at_least_fp32(logits)
    if isinstance(temperature, torch.Tensor):
        logits = logits / temperature.to(logits.dtype).unsqueeze(-1)
    elif temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(-1)  # (B, T)


def clipped_surrogate(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = DUAL_CLIP,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's pessimistic surrogate, negated, with dual-clip: (B, T) each -> (loss, clipped,
    ratio), all (B, T). As verl's ``compute_policy_loss_vanilla``:

        ratio = exp(clamp(logp - logp_old, -20, 20))
        l     = max(-A ratio, -A clip(ratio, 1 - clip_low, 1 + clip_high))
        l     = min(l, -A c)   where A < 0 (dual-clip, c = ``dual_clip``; 0 or None: off)

    Without dual-clip, a token with A < 0 and a large ratio has an unbounded loss (and
    gradient); dual-clip caps it at -A c. ``clipped`` marks tokens where a clip is taken and
    changes the loss: their gradient is zero (ratio above 1 + clip_high with A > 0, below
    1 - clip_low with A < 0, or above c with A < 0).
    """
    log_ratio = torch.clamp(logprobs - old_logprobs, min=-LOG_RATIO_CLAMP, max=LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)  # (B, T)
    unclipped = ratio * advantages  # (B, T)
    clipped_ratio = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    clipped = clipped_ratio * advantages  # (B, T)
    loss = -torch.minimum(unclipped, clipped)  # (B, T)
    was_clipped = clipped < unclipped  # strict: ties keep the gradient
    if dual_clip:
        assert dual_clip > 1.0, f"dual_clip must be > 1 (or 0/None: off), got {dual_clip}"
        capped = -advantages * dual_clip  # (B, T)
        negative = advantages < 0
        was_clipped = was_clipped | (negative & (loss > capped))
        loss = torch.where(negative, torch.minimum(loss, capped), loss)
    return loss, was_clipped, ratio


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Schulman's k3 estimator of KL(pi_theta || pi_ref) per token: (B, T) -> (B, T), >= 0."""
    log_ratio = ref_logprobs - logprobs  # (B, T)
    return torch.exp(log_ratio) - log_ratio - 1.0


def truncated_is_weights(
    proximal_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, *, clip: float = 2.0
) -> torch.Tensor:
    """min(pi_proximal / pi_behaviour, clip) per token, detached: (B, T) -> (B, T)."""
    with torch.no_grad():
        return torch.exp(proximal_logprobs - behaviour_logprobs).clamp(max=clip)


def aggregate(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    norm_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss over the (B, T) mask to a scalar.

    token-mean               sum(m l) / sum(m)
    seq-mean-token-mean      mean over rows of sum_t(m l) / sum_t(m)
    seq-mean-token-sum-norm  mean over rows of sum_t(m l) / norm_tokens (a constant)

    ``total_tokens`` / ``total_seqs`` are the whole batch's counts when this call sees only a
    micro-batch or one data-parallel shard: the partial results then add up to the full loss.
    Rows with no model token count for nothing in any mode.
    """
    masked = torch.where(mask.bool(), per_token, torch.zeros_like(per_token))  # (B, T)
    row_tokens = mask.to(per_token.dtype).sum(-1)  # (B,)
    if mode == "token-mean":
        denom = total_tokens if total_tokens is not None else float(row_tokens.sum())
        return masked.sum() / max(denom, 1.0)
    seqs = total_seqs if total_seqs is not None else float((row_tokens > 0).sum())
    if mode == "seq-mean-token-mean":
        per_row = masked.sum(-1) / row_tokens.clamp(min=1.0)  # (B,)
        return per_row.sum() / max(seqs, 1.0)
    if mode == "seq-mean-token-sum-norm":
        assert norm_tokens is not None and norm_tokens > 0, (
            "seq-mean-token-sum-norm needs norm_tokens"
        )
        return masked.sum() / norm_tokens / max(seqs, 1.0)
    raise ValueError(f"loss aggregation {mode!r} is not one of {AGGREGATIONS}")


@dataclass
class LossSums:
    """Per-token statistics summed over model tokens, so micro-batches and shards add up."""

    tokens: float = 0.0
    clipped: float = 0.0
    kl: float = 0.0
    entropy: float = 0.0
    ratio: float = 0.0

    def __iadd__(self, other: LossSums) -> LossSums:
        for name in ("tokens", "clipped", "kl", "entropy", "ratio"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        return self


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = DUAL_CLIP,
    mode: str = "token-mean",
    is_weights: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    total_tokens: float | None = None,
    total_seqs: float | None = None,
    norm_tokens: float | None = None,
    sums: bool = True,
) -> tuple[torch.Tensor, LossSums]:
    """The aggregated GRPO loss of (B, T) inputs, and its summed statistics (empty without
    ``sums``: they read values back from the device)."""
    m = mask.bool()
    # Padding and prompt positions hold arbitrary values; pinning them to the current log-probs
    # keeps exp() finite there, so no inf * 0 = NaN can leak into the gradient.
    old_logprobs = torch.where(m, old_logprobs, logprobs.detach())
    if ref_logprobs is not None:
        ref_logprobs = torch.where(m, ref_logprobs, logprobs.detach())
    per_token, clipped, ratio = clipped_surrogate(
        logprobs,
        old_logprobs,
        advantages,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
    )  # (B, T)
    if is_weights is not None:
        per_token = per_token * is_weights
    kl = torch.zeros_like(per_token)
    if ref_logprobs is not None:
        kl = k3_kl(logprobs, ref_logprobs)  # (B, T)
        if kl_coef:
            per_token = per_token + kl_coef * kl
    if entropy is not None and entropy_coef:
        # Entropy bonus: keeps a tiny policy exploring instead of collapsing onto one answer
        # while groups are still flat (see the module docstring).
        per_token = per_token - entropy_coef * torch.where(m, entropy, torch.zeros_like(entropy))
    loss = aggregate(
        per_token,
        mask,
        mode,
        total_tokens=total_tokens,
        total_seqs=total_seqs,
        norm_tokens=norm_tokens,
    )
    if not sums:
        return loss, LossSums()
    return loss, LossSums(
        tokens=float(m.sum()),
        clipped=float(clipped[m].sum()),
        kl=float(kl.detach()[m].sum()),
        ratio=float(ratio.detach()[m].sum()),
    )
