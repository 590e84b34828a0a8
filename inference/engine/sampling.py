"""Next-token sampling for a batch, and the logprobs the engine reports.

Reported logprob: log_softmax(logits / temperature) of the chosen token, before top_p, top_k
and min_p filtering (SGLang's default: the temperature-scaled distribution, not the truncated
one). Greedy requests (temperature 0) report log_softmax(logits), as SGLang does by sampling
them at temperature 1 with top_k 1. So at temperature 1 with no filtering the logprobs are the
model's own log-probabilities, which is what the trainer recomputes; calls sampled with
filtering are refused for training upstream, since their logprobs cannot be reproduced.

Each row samples with its own torch.Generator (seeded from `sampling_seed`, else from the
engine's generator), so a seeded request draws the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .request import SamplingParams


@dataclass(frozen=True)
class Draw:
    token: int
    logprob: float
    top: list[tuple[float, int]] | None  # the top_logprobs_num best (logprob, token id)


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator],
    top_n: list[int],
) -> list[Draw]:
    """Draw one token per row of `logits` (B, V)."""
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype)[
        :, None
    ]  # (B, 1)
    logprobs = torch.log_softmax(logits / temps, dim=-1)  # (B, V)
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    draws = []
    for row, (p, gen) in enumerate(zip(params, generators, strict=True)):
        lp = logprobs[row]  # (V,)
        if p.greedy:
            token = int(torch.argmax(logits[row]))
        else:
            probs = _filter(lp.exp(), p) if p.filtered else lp.exp()
            token = int(torch.multinomial(probs, 1, generator=gen))
        top = None
        if top_n[row] > 0:
            values, ids = torch.topk(lp, top_n[row])
            top = [(float(v), int(i)) for v, i in zip(values, ids, strict=True)]
        draws.append(Draw(token=token, logprob=float(lp[token]), top=top))
    return draws


def _filter(probs: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """Zero what top_k, top_p and min_p exclude (as SGLang's torch fallback does)."""
    sorted_probs, order = probs.sort(descending=True)  # (V,)
    cum = sorted_probs.cumsum(0)
    drop = (cum - sorted_probs) > p.top_p
    if p.top_k > 0:
        drop |= torch.arange(probs.numel()) >= p.top_k
    if p.min_p > 0:
        drop |= sorted_probs < sorted_probs[0] * p.min_p
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter(0, order, sorted_probs)
