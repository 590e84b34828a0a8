"""The local engine's sampler (inference/engine/sampling.py): one uniform per row inverts the
row's cumulative distribution, so draws follow the probabilities, a filtered-out token is never
drawn, and each row's draws come from its own generator whatever else is in the batch.

Every draw is seeded, so each test gives the same draws on every run on a machine; the
frequency test's threshold is set so that a correct sampler fails it with probability 1e-6 over
the seed (chi-square with 2 degrees of freedom: P(X > 27.6) = exp(-27.6 / 2) = 1e-6), and
another kernel set moves a draw only when its uniform falls within ~1e-7 of a boundary."""

from __future__ import annotations

import math

import torch

from agentarium.inference.engine.request import SamplingParams
from agentarium.inference.engine.sampling import sample

DRAWS = 20_000


def draw_many(logits: torch.Tensor, params: SamplingParams, seed: int) -> list[int]:
    """DRAWS tokens from ``logits`` (V,), in batches of 100 rows, each row its own generator."""
    out: list[int] = []
    for batch in range(DRAWS // 100):
        generators = [
            torch.Generator().manual_seed(seed * 10**6 + batch * 100 + i) for i in range(100)
        ]
        draws = sample(logits.expand(100, -1).clone(), [params] * 100, generators, [0] * 100)
        out += [d.token for d in draws]
    return out


def test_draws_follow_the_temperature_scaled_probabilities():
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0])  # the last one impossible
    logits = probs.clamp(min=1e-45).log() * 2  # at temperature 2: the probabilities above
    tokens = draw_many(logits, SamplingParams(temperature=2.0), seed=1)
    counts = [tokens.count(i) for i in range(4)]
    assert counts[3] == 0, counts
    expected = [DRAWS * float(p) for p in probs[:3]]
    chi2 = sum((c - e) ** 2 / e for c, e in zip(counts[:3], expected, strict=True))
    assert chi2 < 27.6, (counts, chi2)  # P(false failure) = 1e-6: module docstring


def test_a_filtered_token_is_never_drawn_and_the_reported_logprob_is_the_unfiltered_one():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    params = SamplingParams(top_k=2)
    tokens = draw_many(logits, params, seed=2)
    assert set(tokens) == {0, 1}  # both kept tokens drawn, nothing else
    share = tokens.count(0) / DRAWS  # e^2 / (e^2 + e^1) = 0.731
    assert abs(share - math.e / (math.e + 1)) < 5 * math.sqrt(0.731 * 0.269 / DRAWS)  # 5 sd
    (draw,) = sample(logits[None], [params], [torch.Generator().manual_seed(0)], [0])
    assert math.isclose(draw.logprob, float(torch.log_softmax(logits, -1)[draw.token]))


def test_a_seeded_row_draws_the_same_whatever_else_is_in_the_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000) * 3
    params = [SamplingParams(sampling_seed=5)] * 8

    def gens() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(8)]

    together = [d.token for d in sample(logits, params, gens(), [0] * 8)]
    alone = [sample(logits[i : i + 1], params[:1], [g], [0])[0].token for i, g in enumerate(gens())]
    assert together == alone
    greedy = sample(logits, [SamplingParams(temperature=0.0)] * 8, gens(), [0] * 8)
    assert [d.token for d in greedy] == logits.argmax(-1).tolist()
