"""Task producers: the SDK that publishes rollout jobs, the one job factory, the trajectory
reader and feed, and the run session the orchestrator, eval and the demo share."""

from .errors import ProducerError, StreamMissing
from .feed import TrajectoryFeed
from .jobs import (
    JobOptions,
    TaskRow,
    check_expansion,
    expand_rows,
    expand_tasks,
    group_id_for,
    job_id_for,
    make_job,
    task_id_of,
)
from .reader import TrajectoryReader
from .refill import GroupRefill, TaskSource
from .routing import AGENT_COLUMN, SOURCE_COLUMN, RoutingProblem, Unrouted, agent_of
from .sdk import MAX_IN_FLIGHT, SubmitResult, TaskProducer
from .session import RunSession
from .taskfile import TaskFile, TaskFileError, read_task_file, read_tasks

__all__ = [
    "AGENT_COLUMN",
    "MAX_IN_FLIGHT",
    "SOURCE_COLUMN",
    "GroupRefill",
    "JobOptions",
    "ProducerError",
    "RoutingProblem",
    "RunSession",
    "StreamMissing",
    "SubmitResult",
    "TaskProducer",
    "TaskFile",
    "TaskFileError",
    "TaskRow",
    "TaskSource",
    "TrajectoryFeed",
    "TrajectoryReader",
    "Unrouted",
    "agent_of",
    "check_expansion",
    "expand_rows",
    "expand_tasks",
    "group_id_for",
    "job_id_for",
    "make_job",
    "read_task_file",
    "read_tasks",
    "task_id_of",
]
