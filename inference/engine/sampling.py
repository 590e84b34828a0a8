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
    """Draw one token per row of `logits` (B, V).

    A row samples by inverting its cumulative distribution at one uniform draw from its own
    generator: the token i with cdf[i-1] <= u * cdf[-1] < cdf[i], the cumulative sums in
    float64 (off by ~V x 2^-53 of the total, against fp32 probabilities' own 2^-24), so a token
    of probability 0 (filtered out) is never drawn. One uniform per row, where torch.multinomial
    draws an exponential per vocabulary entry (a fifth of a decode step at batch 64)."""
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params], dtype=logits.dtype)[
        :, None
    ]  # (B, 1)
    logprobs = torch.log_softmax(logits / temps, dim=-1)  # (B, V)
    logprobs = logprobs.clamp(min=torch.finfo(logprobs.dtype).min)
    tokens = [0] * len(params)
    drawn = [row for row, p in enumerate(params) if not p.greedy]
    if drawn:
        probs = logprobs[drawn].exp()  # (R, V)
        for i, row in enumerate(drawn):
            if params[row].filtered:
                probs[i] = _filter(probs[i], params[row])
        cdf = probs.double().cumsum(dim=-1)  # (R, V)
        u = torch.cat(
            [torch.rand(1, generator=generators[row], dtype=torch.float64) for row in drawn]
        )
        picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]  # (R,)
        for i, row in enumerate(drawn):
            token = int(picked[i])
            if token >= probs.shape[1] or probs[i, token] <= 0:  # u * total rounded up to total
                token = int(probs[i].nonzero()[-1])
            tokens[row] = token
    draws = []
    for row, p in enumerate(params):
        lp = logprobs[row]  # (V,)
        token = int(torch.argmax(logits[row])) if p.greedy else tokens[row]
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
