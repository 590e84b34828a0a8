"""The orchestrator: the seed's synchronous batch API over the asynchronous pipeline, with
verl-shaped training batches."""

from .api import AgentOrchestrator
from .batch_data import BatchDataError
from .batches import BatchState
from .config import OrchestratorConfig
from .ray_consumers import RayConfig
from .tensorize import MODES, TrainingBatch, tensorize

__all__ = [
    "MODES",
    "AgentOrchestrator",
    "BatchDataError",
    "BatchState",
    "OrchestratorConfig",
    "RayConfig",
    "TrainingBatch",
    "tensorize",
]
