"""The CPU demo: broker, engine, consumers, trainer and syncer as child processes on one machine."""

from .run import DEFAULT_TASKS, DemoConfig, run_demo

__all__ = ["DEFAULT_TASKS", "DemoConfig", "run_demo"]
