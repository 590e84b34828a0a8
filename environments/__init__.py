"""Environment services: environments that agents open sessions with, over NATS.

This package is a component of its own: it imports only ``schemas`` and ``broker``.
"""

from .agentbench import AgentBenchEnvironment, AgentBenchError, bridge_class
from .base import Environment
from .sandbox import SandboxLimits
from .shell import ShellEnvironment

__all__ = [
    "AgentBenchEnvironment",
    "AgentBenchError",
    "Environment",
    "SandboxLimits",
    "ShellEnvironment",
    "bridge_class",
]
