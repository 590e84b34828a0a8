"""Task producers: the SDK that publishes rollout jobs, and the trajectory reader."""

from .errors import ProducerError, StreamMissing
from .jobs import expand_tasks
from .reader import TrajectoryReader
from .retry import RetryPolicy
from .sdk import SubmitResult, TaskProducer

__all__ = [
    "ProducerError",
    "RetryPolicy",
    "StreamMissing",
    "SubmitResult",
    "TaskProducer",
    "TrajectoryReader",
    "expand_tasks",
]
