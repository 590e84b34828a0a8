"""The CPU demo: broker, engine, consumers, trainer and syncer as child processes on one machine."""

from .report import first_last, task_column, task_rewards
from .run import DEFAULT_TASKS, DemoConfig, run_demo
from .tasks import FAMILIES, TaskFamily

__all__ = [
    "DEFAULT_TASKS",
    "FAMILIES",
    "DemoConfig",
    "TaskFamily",
    "first_last",
    "run_demo",
    "task_column",
    "task_rewards",
]
