"""Environment services: environments that agents open sessions with, over NATS.

This package is a component of its own: it imports only ``schemas`` and ``broker``. The
interface (``Environment``), the worker that serves one as a NATS micro service
(``EnvWorker``), the built-in environments by name (``load_environment``: ``sql``, ``shell``)
and the observation cap.
"""

from .agentbench import AgentBenchEnvironment, AgentBenchError, bridge_class
from .base import Environment, check_options
from .caps import TooLarge, cap_observation, cap_step_result
from .config import EnvWorkerConfig, default_worker_id
from .registry import BUILTIN, EnvironmentLoadError, load_environment, service_name
from .sandbox import SandboxLimits
from .service import KIND as SERVICE_KIND
from .shell import ShellEnvironment
from .sql import SqlEnvironment
from .stats import WorkerCounters
from .worker import EnvWorker

__all__ = [
    "AgentBenchEnvironment",
    "AgentBenchError",
    "BUILTIN",
    "EnvWorker",
    "EnvWorkerConfig",
    "Environment",
    "EnvironmentLoadError",
    "SERVICE_KIND",
    "SandboxLimits",
    "ShellEnvironment",
    "SqlEnvironment",
    "TooLarge",
    "WorkerCounters",
    "bridge_class",
    "cap_observation",
    "cap_step_result",
    "check_options",
    "default_worker_id",
    "load_environment",
    "service_name",
]
