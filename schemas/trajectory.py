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


@dataclass(frozen=True, kw_only=True)
class LLMCall(WireMessage):
    """One LLM call of a rollout: the exact prompt and generated tokens, as the backend saw them.

    ``policy`` says who generated them: the policy being trained (true), or another model that
    cross-sampling sent the call to (false), whose tokens a trainer keeps as context only.
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
        doc="weight version of the model that served the call, as its engine reports it",
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
        "re-encoded), or why extending was refused and the messages rendered (tools_changed, "
        "reply_rerendered, history_rewritten, no_turn_end); empty without token ids",
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
