"""What the trainer's update tests share, on the tiny model (the torch side: trainlib.py keeps to
what needs no torch): batches (``batch``, the five rows ``five_row`` builds, of different
lengths, temperatures, an observation and stale tokens; ``batch_of``, ``rows`` one-call
trajectories collated), the step settings the padded/packed comparisons use (``BASE``), one
forward/backward's loss, statistics and gradients (``update``), and two of those compared in
fp64 (``assert_same_update``, to ``TOL``, derived here). Importing it runs torch on one thread,
as the test modules these helpers came from did (and still do)."""

from __future__ import annotations

import pytest
import torch

from agentarium.schemas import LLMCall, Trajectory
from agentarium.trainer.batch import Batch, Row, Sample, build_rows, collate
from agentarium.trainer.step import StepSettings, Totals, forward_backward

torch.set_num_threads(1)
V = 263  # the tiny model's vocabulary
BASE = dict(kl_coef=0.1, entropy_coef=0.01, clip_low=0.1, clip_high=0.3)


def five_row(i: int, prompt: list[int], response: list[int], *, observation_at: int, stale: int,
             job_id: str) -> Row:  # fmt: skip
    """Row ``i`` of a five-row batch: model tokens at temperature 0.6-1.3 by ``i``, row 3 with a
    two-token observation ``observation_at`` tokens into its response, row 4 with its first
    ``stale`` model tokens too stale (tis), advantages of alternating sign."""
    mask = [0] * len(prompt) + [1] * len(response)
    if i == 3:
        at = len(prompt) + observation_at
        mask[at : at + 2] = [0, 0]
    temperature = [1.0] * len(prompt) + [(0.6, 1.0, 1.3, 0.8, 1.0)[i]] * len(response)
    old = [0.0] * len(prompt) + [-5.0 + 0.3 * j for j in range(len(response))]
    return Row(
        input_ids=prompt + response,
        loss_mask=mask,
        old_logprobs=[o if m else 0.0 for o, m in zip(old, mask, strict=True)],
        temperature=temperature,
        advantage=(-1) ** i * 0.4 * (i + 1),
        tis=[0] * len(prompt) + [int(i == 4 and j < stale) for j in range(len(response))],
        job_id=job_id,
    )


def batch() -> Batch:
    """Five rows of different lengths: prompts, responses of one to four calls' worth of model
    tokens at temperatures 0.6-1.3, an observation in the middle of one, a row whose first
    half of model tokens is too stale (tis: a call that crossed a weight update)."""
    g = torch.Generator().manual_seed(3)
    rows = []
    for i in range(5):
        prompt = torch.randint(0, 256, (6 + 3 * i,), generator=g).tolist()
        response = torch.randint(0, 256, (2 + 2 * i,), generator=g).tolist()
        rows.append(
            five_row(i, prompt, response, observation_at=2, stale=len(response) // 2,
                     job_id=f"j{i}")
        )  # fmt: skip
    return collate(rows, pad_id=256)


def update(model, ref, data: Batch, settings: StepSettings):
    """Loss, summed statistics and every parameter's gradient of one forward/backward."""
    model.zero_grad(set_to_none=True)
    loss, sums = forward_backward(model, ref, data, settings, Totals.of(data), "cpu")
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss, sums, grads


# The paths compared run in float64 (``load_model(..., dtype="float64")``; at_least_fp32 keeps
# fp64 log-probs fp64) and differ only in the order and blocking of their sums. A sum of n terms
# is off by at most n * u * sum|terms| (u = 2**-53 = 1.1e-16); the longest chain here, a
# log-softmax over V = 263 after matmuls of width <= 256 and sums over <= 28 tokens, has
# n < 600: a relative error under 600 * 1.1e-16 = 7e-14 of each quantity's scale (loss 0.12,
# entropy sum 155, gradient entries <= 0.12). Measured: <= 2.8e-14 on the entropy sum (1.8e-16
# of it), <= 6e-17 on gradients, on both kernel sets. The tolerance, 1e-10 relative (and 1e-10
# absolute for gradients near 0), leaves three orders over that bound; what chunking could break
# (a shifted position, a lost temperature, a chunk scaled twice) moves a log-prob by >= 1e-3.
# In fp32 the same sums differed by up to 1.5e-5 (the entropy sum), which the old guessed
# rel=1e-5 passed by a factor of 100 only.
TOL = 1e-10


def assert_same_update(whole, chunked) -> None:
    assert chunked[0] == pytest.approx(whole[0], rel=TOL, abs=TOL)
    for name in ("tokens", "clipped", "kl", "entropy", "ratio"):
        assert getattr(chunked[1], name) == pytest.approx(
            getattr(whole[1], name), rel=TOL, abs=TOL
        ), name
    assert chunked[2].keys() == whole[2].keys() and whole[2]
    for name, grad in whole[2].items():
        assert grad.dtype == torch.float64, name
        torch.testing.assert_close(chunked[2][name], grad, atol=TOL, rtol=TOL, msg=name)
    assert max(float(g.abs().max()) for g in whole[2].values()) > 1e-4  # a real gradient


def batch_of(rows: int):
    samples = []
    for i in range(rows):
        n = 1 + i % 3  # uneven lengths, so the shards pad differently
        call = LLMCall(
            prompt_ids=[257, 60 + i, 61, 62 + i % 2],
            response_ids=[48 + i % 10, 49, 258][-n:],
            response_logprobs=[-5.0, -4.0, -6.0][:n],
            finish_reason="stop",
            temperature=1.0 if i % 2 else 0.8,
        )
        traj = Trajectory(
            job_id=f"j{i}",
            agent="a",
            task_id="t",
            group_id="g",
            status="ok",
            reward=float(i % 2),
            calls=[call],
        )
        samples.append(Sample(traj, advantage=(i % 4 - 1.5) / 1.1, tis=i == 3))
    return collate(build_rows(samples)[0], pad_id=256)
