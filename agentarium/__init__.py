"""Agentarium: the rollout layer for agentic RL on NATS JetStream.

The names users import live here; they load lazily so ``agentarium --help`` and a
consumer process do not pay for torch or transformers they do not use.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "AgentOrchestrator": "agentarium.orchestrator",
    "OrchestratorConfig": "agentarium.orchestrator",
    "TaskProducer": "agentarium.producers",
    "SubmitResult": "agentarium.producers",
    "TrajectoryReader": "agentarium.producers",
    "Job": "agentarium.schemas",
    "Sampling": "agentarium.schemas",
    "Trajectory": "agentarium.schemas",
    "LLMCall": "agentarium.schemas",
    "WeightUpdate": "agentarium.schemas",
    "DeadLetter": "agentarium.schemas",
    "ChatResult": "agentarium.consumers",
    "TracingLLM": "agentarium.consumers",
    "ProgramOutput": "agentarium.consumers",
    "program_agent": "agentarium.consumers",
    "NatsSettings": "agentarium.broker",
    "Topology": "agentarium.broker",
    "ensure_tiny_model": "agentarium.tiny",
    "ensure_smol_model": "agentarium.smol",
    "resolve_model": "agentarium.models",
}

__all__ = [
    "AgentOrchestrator",
    "ChatResult",
    "DeadLetter",
    "Job",
    "LLMCall",
    "NatsSettings",
    "OrchestratorConfig",
    "ProgramOutput",
    "Sampling",
    "SubmitResult",
    "TaskProducer",
    "Topology",
    "TracingLLM",
    "Trajectory",
    "TrajectoryReader",
    "WeightUpdate",
    "__version__",
    "ensure_smol_model",
    "ensure_tiny_model",
    "program_agent",
    "resolve_model",
]
assert sorted(__all__) == sorted([*_EXPORTS, "__version__"]), "keep __all__ and _EXPORTS in step"


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'agentarium' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
