"""One trajectory as one training sample: a prompt, then a completion with its loss mask.

RL frameworks take one sequence per sample: TRL's ``prompt_ids`` / ``completion_ids`` /
``env_mask``, verl's ``AgentLoopOutput`` (``prompt_ids`` / ``response_ids`` /
``response_mask``). A trajectory becomes that sequence by the trainer's own rule
(``trainer.rows_of``, ``concat``): its first call's prompt, then everything after it, the
model's tokens with mask 1 and what came between them (tool results, environment turns,
another model's cross-sampled replies) with mask 0.

A trajectory is **usable** only when it is ``ok`` and makes exactly one row. Everything else
is unusable, with its reason in ``status``, and carries no reward (None), never 0:

| status | when |
|---|---|
| ``error``, ``timeout`` | the rollout failed (the consumer's statuses) |
| ``missing`` | no trajectory was stored in time |
| ``no_tokens`` | no call with token ids and a generated token (an OpenAI-compatible backend) |
| ``mismatch`` | several calls whose prompts do not extend each other token for token (a chat template that re-renders history): not one sequence |

Versions are the run's (``run_version`` with the trajectory's run: 0 for the base weights, the
version of the run's own identity, None for weights that are not the run's): ``weight_version``
is the oldest among the policy's calls, and ``token_versions`` gives each completion token its
own (an engine updated in place mid-call generated one call with two: ``LLMCall.weight_spans``),
None where the mask is 0.

``trainer`` is imported for ``rows_of`` alone; ``import agentarium.trainer`` loads the same third-party
modules as ``producers`` (nats, structlog, numpy), never torch, so this also runs in verl's
virtualenv.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from agentarium.schemas import Trajectory, run_version
from agentarium.trainer import rows_of

UNUSABLE = ("error", "timeout", "missing", "no_tokens", "mismatch")


@dataclass(frozen=True)
class Sample:
    """One sample. ``mask``, ``logprobs`` and ``token_versions`` align with ``completion_ids``;
    ``reward`` is None unless ``usable``. ``weight_version`` is the oldest of the run's versions
    among the policy's calls (None without one); ``token_versions`` each model token's version
    of the run (None where the mask is 0, or for weights that are not the run's)."""

    status: str  # "ok" or one of UNUSABLE
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    reward: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    weight_version: int | None = None
    token_versions: list[int | None] = field(default_factory=list)
    turns: int = 0
    error: str | None = None

    @property
    def usable(self) -> bool:
        return self.status == "ok"


def sample_of(trajectory: Trajectory | None) -> Sample:
    """The sample of a stored trajectory (None: it never arrived)."""
    if trajectory is None:
        return Sample("missing", error="no trajectory was stored within the wait")
    run = trajectory.run
    versions = {
        run_version(v, run) for c in trajectory.calls if c.policy for v, _, _ in c.version_spans()
    }
    version = min((v for v in versions if v is not None), default=None)
    base = Sample(
        "ok", metrics=dict(trajectory.metrics), weight_version=version, turns=len(trajectory.calls)
    )
    if trajectory.status != "ok":
        return replace(base, status=trajectory.status, error=trajectory.error)
    rows, how = rows_of(trajectory, "concat")
    if how in ("no_token_ids", "empty"):
        return replace(base, status="no_tokens", error=f"no call with token ids ({how})")
    if len(rows) != 1:
        return replace(
            base,
            status="mismatch",
            error=f"{len(rows)} calls whose prompts do not extend each other token for token",
        )
    row = rows[0]
    return replace(
        base,
        prompt_ids=row.prompt_ids,
        completion_ids=row.response_ids,
        mask=row.response_mask,
        logprobs=row.response_logprobs,
        token_versions=_token_versions(row.response_versions, row.response_mask, run),
        reward=trajectory.reward,
    )


def _token_versions(versions: list[str], mask: list[int], run: str) -> list[int | None]:
    known = {v: run_version(v, run) for v in set(versions)}  # a few versions, many tokens
    return [known[v] if m else None for v, m in zip(versions, mask, strict=True)]
