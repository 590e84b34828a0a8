"""Task producers: the SDK that publishes rollout jobs, and the trajectory reader."""

from .errors import ProducerError, StreamMissing
from .jobs import expand_tasks
from .reader import TrajectoryReader
from .retry import PublishRetry
from .sdk import SubmitResult, TaskProducer

__all__ = [
    "ProducerError",
    "PublishRetry",
    "StreamMissing",
    "SubmitResult",
    "TaskProducer",
    "TrajectoryReader",
    "expand_tasks",
]
