"""Trajectory: the traced outcome of one job, with every LLM call's tokens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .errors import SchemaError
from .fields import (
    BOOL,
    FLOAT,
    INT,
    LOGPROBS,
    METRICS,
    NAME,
    OBJECT,
    OPT_FLOAT,
    OPT_STR,
    STR,
    TOKENS,
    Kind,
    WireMessage,
    finite,
    nested,
    spec,
)

STATUSES = ("ok", "error", "timeout")
FINISH_REASONS = ("stop", "length", "abort", "tool_calls")

MESSAGES = Kind(
    {"type": ["array", "null"], "items": {"type": "object"}},
    lambda value, path: None if value is None else _read_messages(value, path),
    lambda value, binary: list(value),
)


def _read_messages(value, path):
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, dict) for m in value):
        raise SchemaError(f"{path}: expected a list of chat message objects", field=path)
    return list(value)


def _read_spans(value, path) -> list[tuple[str, int]]:
    """``[[version, first output-token index], ...]`` as a list of (str, int) pairs; the order
    rules (first 0, increasing, within the response) are LLMCall's own checks."""
    if not isinstance(value, (list, tuple)):
        raise SchemaError(
            f"{path}: expected a list of [version, first token index] pairs", field=path
        )
    spans = []
    for i, pair in enumerate(value):
        if (
            not isinstance(pair, (list, tuple))
            or len(pair) != 2
            or not isinstance(pair[0], str)
            or isinstance(pair[1], bool)
            or not isinstance(pair[1], int)
        ):
            raise SchemaError(
                f"{path}[{i}]: expected a [version string, first token index] pair, "
                f"got {str(pair)[:80]}",
                field=path,
            )
        spans.append((STR.read(pair[0], f"{path}[{i}][0]"), pair[1]))
    return spans


def spans_problem(spans: list[tuple[str, int]], tokens: int, last_version: str) -> str | None:
    """What is wrong with non-empty ``weight_spans`` of a response of ``tokens`` tokens whose
    last token's version is ``last_version``, or None: the one rule, for LLMCall and for the
    backends that read an engine's spans."""
    starts = [start for _, start in spans]
    if starts[0] != 0:
        return f"the first span starts at token {starts[0]}, not 0"
    if any(b <= a for a, b in zip(starts, starts[1:], strict=False)):
        return f"span starts {starts} are not strictly increasing"
    if starts[-1] >= tokens:
        return f"a span starts at token {starts[-1]} of a response of {tokens}"
    if spans[-1][0] != last_version:
        return (
            f"the last span's version {spans[-1][0]!r} is not weight_version "
            f"{last_version!r} (the version of the last token)"
        )
    return None


WEIGHT_SPANS = Kind(
    {
        "type": "array",
        "items": {
            "type": "array",
            "prefixItems": [{"type": "string"}, {"type": "integer", "minimum": 0}],
            "minItems": 2,
            "maxItems": 2,
        },
    },
    _read_spans,
    lambda value, binary: [[version, start] for version, start in value],
)


@dataclass(frozen=True, kw_only=True)
class LLMCall(WireMessage):
    """One LLM call of a rollout: the exact prompt and generated tokens, as the backend saw them.

    ``policy`` says who generated them: the policy being trained (true), or another model that
    cross-sampling sent the call to (false), whose tokens a trainer keeps as context only.

    ``weight_version`` names the weights of the call's last token. An engine updated in place
    while the call ran (pause, update, continue) generated its tokens with two versions or more:
    ``weight_spans`` then lists each version with the index of its first response token, so a
    trainer measures every token's staleness by its own version (``version_spans``).
    """

    prompt_ids: list[int] = spec(TOKENS, doc="prompt token ids sent to the backend")
    response_ids: list[int] = spec(TOKENS, doc="generated token ids, stop token included")
    response_logprobs: list[float] = spec(
        LOGPROBS, doc="logprob of each generated token, aligned with response_ids"
    )
    finish_reason: str = spec(STR, doc="stop | length | abort | tool_calls")
    weight_version: str = spec(
        STR,
        "default",
        doc="the weights that generated the call's last token, as its engine reports them: "
        "'default' (the engine's initial weights) or '<run>@<version>:<checksum>'",
    )
    weight_spans: list[tuple[str, int]] = spec(
        WEIGHT_SPANS,
        factory=list,
        doc="every version the call's tokens came from, when the weights changed while it "
        "ran: [version, first response token index] pairs in order, the first at 0, indices "
        "increasing, the last version equal to weight_version; empty: every token came from "
        "weight_version",
    )
    temperature: float = spec(FLOAT, 1.0, doc="sampling temperature used")
    top_p: float = spec(FLOAT, 1.0, doc="top_p used")
    top_k: int = spec(INT, -1, doc="top_k used, -1 = off")
    latency_s: float = spec(FLOAT, 0.0, doc="wall time of the call")
    backend: str = spec(STR, "", doc="the server that answered (URL)")
    model: str = spec(
        STR,
        "",
        doc="name of the model that generated the reply (the other model's when policy is false)",
    )
    policy: bool = spec(
        BOOL,
        True,
        doc="true when the policy being trained generated the reply; false when cross-sampling "
        "sent the call to another model: its tokens are context, never trained on, and its "
        "weight_version is not the policy's",
    )
    cached_tokens: int = spec(INT, 0, doc="prompt tokens served from the backend's prefix cache")
    messages: list[dict] | None = spec(
        MESSAGES, None, doc="the chat messages rendered into prompt_ids, plus the reply"
    )
    prompt_build: str = spec(
        STR,
        "",
        doc="how prompt_ids were built: render (the chat template over the messages), extend "
        "(an earlier call's prompt_ids and response_ids, then the new messages' tokens: no reply "
        "re-encoded), reasoning_kept (the same where the chat template drops earlier turns' "
        "reasoning: the sampled ids are kept), after_budget (the rest of a reply cut at its "
        "thinking budget: the first part's ids, then the reasoning's close when it was still "
        "open, tokens never trained), or why extending was refused and the messages rendered "
        "(tools_changed, reply_rerendered, history_rewritten, no_turn_end); empty without token "
        "ids",
    )

    def __post_init__(self) -> None:
        if len(self.response_logprobs) != len(self.response_ids):
            raise SchemaError(
                f"llmcall.response_logprobs has {len(self.response_logprobs)} entries for "
                f"{len(self.response_ids)} response_ids",
                field="llmcall.response_logprobs",
            )
        if self.finish_reason not in FINISH_REASONS:
            raise SchemaError(
                f"llmcall.finish_reason {self.finish_reason!r} is not one of {FINISH_REASONS}",
                field="llmcall.finish_reason",
            )
        if self.weight_spans:
            self._check_spans()

    def _check_spans(self) -> None:
        spans = _read_spans(self.weight_spans, "llmcall.weight_spans")  # also built in Python
        object.__setattr__(self, "weight_spans", spans)
        problem = spans_problem(spans, len(self.response_ids), self.weight_version)
        if problem:
            raise SchemaError(f"llmcall.weight_spans: {problem}", field="llmcall.weight_spans")

    def version_spans(self) -> list[tuple[str, int, int]]:
        """The call's response tokens as ``(version, start, end)`` runs, in order: its
        ``weight_spans``, or one run of ``weight_version`` (``(weight_version, 0, 0)`` for a
        call without response tokens, whose version is still the call's)."""
        if not self.weight_spans:
            return [(self.weight_version, 0, len(self.response_ids))]
        ends = [start for _, start in self.weight_spans[1:]] + [len(self.response_ids)]
        return [
            (version, start, end)
            for (version, start), end in zip(self.weight_spans, ends, strict=True)
        ]

    def token_versions(self) -> list[str]:
        """The version of each response token, aligned with ``response_ids``."""
        out: list[str] = []
        for version, start, end in self.version_spans():
            out.extend([version] * (end - start))
        return out


@dataclass(frozen=True, kw_only=True)
class Trajectory(WireMessage):
    """The result of one job; published once on agentarium.trajectories.<run>.<agent>.<job_id>."""

    WIRE_DOC = (
        "The traced result of one Agentarium job, stored on "
        "agentarium.trajectories.<run>.<agent>.<job_id>."
    )

    job_id: str = spec(NAME, doc="the job's id")
    agent: str = spec(NAME, doc="agent name")
    task_id: str = spec(STR, doc="task id")
    group_id: str = spec(STR, doc="GRPO group key")
    sample_index: int = spec(INT, 0, doc="index in the group")
    group_size: int = spec(INT, 1, doc="group size")
    run: str = spec(NAME, "default", doc="run id")
    batch_id: str = spec(STR, "", doc="producer batch id")
    is_train: bool = spec(BOOL, True, doc="false for evaluation rollouts")
    status: Literal["ok", "error", "timeout"] = spec(
        STR, doc="ok | error | timeout (error/timeout = infrastructure, never reward 0)"
    )
    reward: float | None = spec(OPT_FLOAT, None, doc="the reward; null unless status is ok")
    metrics: dict[str, float] = spec(
        METRICS, factory=dict, doc="named numbers from the agent or reward function"
    )
    error: str | None = spec(
        OPT_STR, None, doc="why the rollout failed (traceback for agent errors)"
    )
    worker_id: str = spec(STR, "", doc="the consumer process that ran it")
    attempts: int = spec(INT, 1, doc="delivery attempt that produced this trajectory")
    started_at: float = spec(FLOAT, 0.0, doc="unix time the rollout started")
    finished_at: float = spec(FLOAT, 0.0, doc="unix time the rollout ended")
    trace_id: str = spec(
        STR, "", doc="OpenTelemetry trace id (32 hex digits), empty when tracing is off"
    )
    span_id: str = spec(
        STR,
        "",
        doc="the rollout span's id (16 hex digits), empty when tracing is off; "
        "what a train step's span links to",
    )
    task: dict = spec(OBJECT, factory=dict, doc="the job's task payload")
    metadata: dict = spec(OBJECT, factory=dict, doc="the job's metadata")
    calls: list[LLMCall] = nested(LLMCall, many=True, doc="every LLM call of the rollout, in order")

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise SchemaError(
                f"trajectory.status {self.status!r} is not one of {STATUSES}",
                field="trajectory.status",
            )
        if self.status == "ok" and not finite(self.reward):
            raise SchemaError(
                "trajectory.reward must be a finite number when status is ok",
                field="trajectory.reward",
            )

    @property
    def ok(self) -> bool:
        return self.status == "ok"
