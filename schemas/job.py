"""Job: one rollout to run, as published on ``agentarium.tasks.<agent>``."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace

from .errors import SchemaError
from .fields import BOOL, FLOAT, INT, NAME, OBJECT, STR, STR_LIST, WireMessage, nested, spec

DEFAULT_DEADLINE_S = 600.0  # a job's wall-clock limit unless its producer says otherwise


@dataclass(frozen=True, kw_only=True)
class Sampling(WireMessage):
    """Sampling parameters for every LLM call of the rollout (an agent may override per call).
    Its fields are settings too: ``agentarium produce``'s ``--temperature`` and the rest
    (``producers.JobOptions`` holds it as a section); the checks below are the wire's."""

    temperature: float = spec(
        FLOAT,
        1.0,
        doc="softmax temperature",
        setting={"help": "sampling temperature", "metavar": "T"},
    )
    top_p: float = spec(
        FLOAT,
        1.0,
        doc="nucleus sampling; training refuses calls with top_p < 1",
        setting={"metavar": "P"},
    )
    top_k: int = spec(
        INT,
        -1,
        doc="top-k sampling, -1 = off; training refuses calls with top_k",
        setting={"metavar": "K"},
    )
    max_new_tokens: int = spec(
        INT, 256, doc="maximum generated tokens per call", setting={"help": "tokens per LLM call"}
    )
    stop: tuple[str, ...] = spec(
        STR_LIST,
        (),
        doc="stop strings",
        setting={"help": "a stop string (repeatable)", "metavar": "TEXT"},
    )

    def __post_init__(self) -> None:
        if not 0 <= self.temperature < math.inf:  # NaN fails too
            raise SchemaError(
                "sampling.temperature must be a finite number >= 0", field="sampling.temperature"
            )
        if not 0 < self.top_p <= 1:
            raise SchemaError("sampling.top_p must be in (0, 1]", field="sampling.top_p")
        if self.top_k != -1 and self.top_k < 1:  # SGLang's rule: 0 is not "off"
            raise SchemaError(
                "sampling.top_k must be -1 (off) or at least 1", field="sampling.top_k"
            )
        if self.max_new_tokens < 1:
            raise SchemaError(
                "sampling.max_new_tokens must be >= 1", field="sampling.max_new_tokens"
            )


@dataclass(frozen=True, kw_only=True)
class Job(WireMessage):
    """One rollout. Only ``job_id``, ``agent`` and ``task`` are required on the wire;
    a lone job is a group of one."""

    WIRE_DOC = (
        "One rollout job for Agentarium, published to agentarium.tasks.<agent>. "
        "Only job_id, agent and task are required; a lone job is a group of one."
    )

    job_id: str = spec(NAME, doc="unique id; also the Nats-Msg-Id and the trajectory subject token")
    agent: str = spec(NAME, doc="agent name; must equal the <agent> token of the subject")
    task: dict = spec(OBJECT, doc="the user's task payload, any JSON object")
    task_id: str = spec(STR, "", doc="the task this sample belongs to (default: job_id)")
    group_id: str = spec(
        STR, "", doc="GRPO group key shared by the G samples of a task (default: job_id)"
    )
    sample_index: int = spec(INT, 0, doc="index of this sample inside its group, 0..group_size-1")
    group_size: int = spec(INT, 1, doc="number of samples in the group")
    run: str = spec(
        NAME,
        "default",
        doc="run id; trajectories go to agentarium.trajectories.<run>.<agent>.<job_id>",
    )
    batch_id: str = spec(STR, "", doc="the batch the producer submitted this job in")
    is_train: bool = spec(
        BOOL, True, doc="false for evaluation/validation rollouts (never trained on)"
    )
    sampling: Sampling = nested(Sampling, default=Sampling, doc="sampling parameters")
    deadline_s: float = spec(
        FLOAT, DEFAULT_DEADLINE_S, doc="wall-clock limit for the rollout; past it status is timeout"
    )
    metadata: dict = spec(OBJECT, factory=dict, doc="free-form, copied to the trajectory")
    created_at: float = spec(FLOAT, 0.0, doc="unix time the producer created the job")

    def __post_init__(self) -> None:
        if not self.task_id:
            object.__setattr__(self, "task_id", self.job_id)
        if not self.group_id:
            object.__setattr__(self, "group_id", self.job_id)
        if self.group_size < 1:
            raise SchemaError("job.group_size must be >= 1", field="job.group_size")
        if not 0 <= self.sample_index < self.group_size:
            raise SchemaError(
                f"job.sample_index {self.sample_index} must be in [0, group_size={self.group_size})",
                field="job.sample_index",
            )
        if not 0 < self.deadline_s < math.inf:  # NaN fails too
            raise SchemaError("job.deadline_s must be a finite number > 0", field="job.deadline_s")

    def stamped(self) -> Job:
        """A copy with ``created_at`` set to now, unless already set."""
        return self if self.created_at else replace(self, created_at=time.time())
