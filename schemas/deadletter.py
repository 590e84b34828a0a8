"""DeadLetter: a job that will not be run again, with the reason, on ``agentarium.dead.<agent>``."""

from __future__ import annotations

from dataclasses import dataclass

from .fields import FLOAT, INT, OBJECT, OPT_STR, STR, WireMessage, spec


@dataclass(frozen=True, kw_only=True)
class DeadLetter(WireMessage):
    WIRE_DOC = (
        "A dead-lettered job: the job (or its raw bytes), the reason, attempts and the last error."
    )

    reason: str = spec(
        STR,
        doc="why it was dead-lettered: invalid_job | wrong_subject | agent_error | max_deliveries"
        " | worker_error | released",
    )
    error: str = spec(STR, "", doc="readable detail: the decoding error or the agent's traceback")
    subject: str = spec(STR, "", doc="the subject the job arrived on")
    job: dict = spec(
        OBJECT, factory=dict, doc="the job as decoded (empty if it could not be decoded)"
    )
    raw: str | None = spec(
        OPT_STR, None, doc="the raw payload, base64, when it could not be decoded"
    )
    job_id: str = spec(STR, "", doc="the job id when known")
    attempts: int = spec(INT, 0, doc="deliveries so far")
    worker_id: str = spec(STR, "", doc="the worker that dead-lettered it")
    at: float = spec(FLOAT, 0.0, doc="unix time")
