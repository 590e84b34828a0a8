"""Environment sessions: the messages between a rollout and an environment service.

An environment runs as a NATS service of its own (``agentarium env serve``). A rollout opens a
session with ``EnvStart`` on ``<prefix>.env.<name>.start`` (a queue group: any worker with room
takes it); the worker answers ``EnvStarted`` naming the subject of the session, and every later
``EnvCall`` (a step or the close) goes there, so a session stays on its worker. Errors come back
as an ``EnvError`` with the ``Nats-Service-Error`` and ``Nats-Service-Error-Code`` headers of the
NATS service API. The interface is function-call based: observations are chat messages plus
OpenAI-style ``tools``, an action is the assistant's message with its ``tool_calls``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import SchemaError
from .fields import (
    BOOL,
    FLOAT,
    INT,
    METRICS,
    NAME,
    OBJECT,
    OPT_FLOAT,
    STR,
    Kind,
    WireMessage,
    nested,
    spec,
)

ENV_OPS = ("step", "close")

# Error codes an environment worker answers with (HTTP-like, as the NATS service API suggests).
ENV_ERROR_CODES = {
    400: "bad_request",  # the message could not be decoded or failed validation
    404: "unknown_session",  # no such session here: expired, closed, or its worker restarted
    408: "deadline_exceeded",  # the session's deadline passed during the step; it is closed
    409: "out_of_order",  # an EnvCall whose seq is neither the next step nor the last one
    413: "too_large",  # a request over the worker's limit
    500: "environment_error",  # the environment raised; the session is closed with a failure
    503: "unavailable",  # full or draining (a start); the client backs off and retries
}


def _read_object_list(value, path):
    if not isinstance(value, (list, tuple)) or not all(isinstance(m, dict) for m in value):
        raise SchemaError(f"{path}: expected a list of objects", field=path)
    return list(value)


OBJECT_LIST = Kind(
    {"type": "array", "items": {"type": "object"}},
    _read_object_list,
    lambda value, binary: list(value),
)


@dataclass(frozen=True, kw_only=True)
class EnvStart(WireMessage):
    """Open a session: sent to ``<prefix>.env.<name>.start``."""

    WIRE_DOC = (
        "Opens an environment session; request on <prefix>.env.<name>.start (queue group). "
        "The answer is an EnvStarted, or an EnvError."
    )

    session_id: str = spec(NAME, doc="client-chosen unique id; a retried start reuses it")
    task: dict = spec(OBJECT, doc="the environment's task: inline data, or {'index': id}")
    job_id: str = spec(STR, "", doc="the rollout's job, for logs and traces")
    deadline_s: float = spec(
        FLOAT, 600.0, doc="the session's wall-clock limit; the worker closes it after this"
    )
    metadata: dict = spec(OBJECT, factory=dict, doc="free-form, passed to the environment")

    def __post_init__(self) -> None:
        if not self.deadline_s > 0:
            raise SchemaError("envstart.deadline_s must be > 0", field="envstart.deadline_s")


@dataclass(frozen=True, kw_only=True)
class Observation(WireMessage):
    """What an environment shows at reset: the opening chat messages and the tools."""

    messages: list = spec(OBJECT_LIST, factory=list, doc="chat messages (role, content)")
    tools: list = spec(
        OBJECT_LIST, factory=list, doc="OpenAI-style tool definitions the agent may call"
    )
    info: dict = spec(OBJECT, factory=dict, doc="free-form")


@dataclass(frozen=True, kw_only=True)
class EnvStarted(WireMessage):
    """The reply to ``EnvStart``."""

    WIRE_DOC = "Reply to EnvStart: where the session lives and its first observation."

    session_id: str = spec(NAME, doc="the session, as the client chose it")
    worker: str = spec(NAME, doc="the worker instance holding the session")
    subject: str = spec(STR, doc="the subject for this session's EnvCall requests")
    observation: Observation = nested(Observation, doc="the opening messages and tools")
    idle_timeout_s: float = spec(FLOAT, 300.0, doc="the session expires after this long idle")


@dataclass(frozen=True, kw_only=True)
class EnvCall(WireMessage):
    """A step or the close of a session, sent to ``EnvStarted.subject``."""

    WIRE_DOC = (
        "A step (op=step, with the assistant message) or the close (op=close) of a session, "
        "sent to the subject EnvStarted named. seq numbers steps from 1; a repeated seq gets "
        "the stored reply again and never runs the step twice."
    )

    op: str = spec(STR, "step", doc="step or close")
    seq: int = spec(INT, 0, doc="1, 2, ... for steps; a retry repeats the seq; ignored by close")
    message: dict = spec(
        OBJECT,
        factory=dict,
        doc="the assistant message: content and OpenAI-style tool_calls (op=step)",
    )

    def __post_init__(self) -> None:
        if self.op not in ENV_OPS:
            raise SchemaError(f"envcall.op must be one of {ENV_OPS}", field="envcall.op")
        if self.op == "step" and self.seq < 1:
            raise SchemaError("envcall.seq must be >= 1 for a step", field="envcall.seq")


@dataclass(frozen=True, kw_only=True)
class StepResult(WireMessage):
    """The reply to a step."""

    WIRE_DOC = "Reply to an EnvCall with op=step."

    seq: int = spec(INT, 0, doc="the seq it answers")
    messages: list = spec(
        OBJECT_LIST, factory=list, doc="tool results (role tool) or user messages to append"
    )
    reward: float | None = spec(OPT_FLOAT, None, doc="an optional per-step reward")
    done: bool = spec(BOOL, False, doc="the episode is over; close the session next")
    truncated: bool = spec(BOOL, False, doc="an observation was cut to the worker's cap")
    info: dict = spec(OBJECT, factory=dict, doc="free-form")


@dataclass(frozen=True, kw_only=True)
class SessionOutcome(WireMessage):
    """The reply to a close: how the episode scored."""

    WIRE_DOC = "Reply to an EnvCall with op=close: the episode's score."

    score: float = spec(FLOAT, 0.0, doc="the episode's reward")
    metrics: dict = spec(METRICS, factory=dict, doc="named numbers, e.g. steps, exit codes")
    info: dict = spec(OBJECT, factory=dict, doc="free-form")
    steps: int = spec(INT, 0, doc="steps the session ran")


@dataclass(frozen=True, kw_only=True)
class EnvError(WireMessage):
    """An error reply (with the NATS service API's error headers)."""

    WIRE_DOC = "An error reply from an environment worker; code as in ENV_ERROR_CODES."

    code: int = spec(INT, doc="400, 404, 408, 409, 413, 500 or 503")
    error: str = spec(STR, doc="short name of the code, e.g. unknown_session")
    message: str = spec(STR, "", doc="what went wrong, in words")


@dataclass(frozen=True, kw_only=True)
class EnvWorkerStats(WireMessage):
    """What one worker instance reports in its ``$SRV.STATS`` reply (the ``start`` endpoint's
    custom ``data``): the NATS service API's built-in stats hold only counts and an average."""

    WIRE_DOC = (
        "An environment worker's figures, the custom data of the start endpoint in its "
        "$SRV.STATS reply (JSON, as the NATS service API wants)."
    )

    worker: str = spec(STR, doc="the worker instance (host-pid-random)")
    env: str = spec(STR, doc="the environment's service name")
    sessions: int = spec(INT, 0, doc="sessions open now")
    capacity: int = spec(INT, 0, doc="the most sessions this worker holds at once")
    starting: int = spec(INT, 0, doc="starts admitted and not finished (reset running)")
    max_starting: int = spec(INT, 0, doc="the most starts admitted at once")
    starts: int = spec(INT, 0, doc="sessions started since the worker began")
    starts_per_s: float = spec(FLOAT, 0.0, doc="sessions started per second over the last 10 s")
    rejected: int = spec(INT, 0, doc="starts answered 503 (full or draining)")
    steps: int = spec(INT, 0, doc="steps run")
    step_p50_ms: float = spec(FLOAT, 0.0, doc="step latency median over the last 2,048 steps")
    step_p99_ms: float = spec(FLOAT, 0.0, doc="step latency 99th percentile, same window")
    closed: int = spec(INT, 0, doc="sessions closed by their client")
    expired: int = spec(INT, 0, doc="sessions the worker closed: idle too long or past deadline")
    errors: int = spec(INT, 0, doc="requests answered 500: the environment raised")
    draining: bool = spec(BOOL, False, doc="SIGTERM received: no new sessions")
    accepting: bool = spec(BOOL, False, doc="listening on the start subject now")
