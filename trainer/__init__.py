"""The asynchronous GRPO trainer: collector, GRPO math, step, checkpoints, metrics, weight
publishing and the weight syncer (see docs/design.md, "The trainer").

``import trainer`` stays light (no torch): the names that need torch load on first use.
"""

from __future__ import annotations

import importlib
from typing import Any

from .app import PublisherFactory, default_weights_dir, run_sync, run_trainer, store_publisher
from .config import DEVICES, LOSS_AGGS, MULTI_TURN, STALE_POLICIES, TrainerConfig
from .errors import CheckpointError, DistributedError, TrainerConfigError, TrainerError
from .metrics import plot_metrics, read_metrics
from .sync import PAUSE_MODES, SyncConfig, WeightSyncer
from .weights import WeightsError, WeightStore

_LAZY = {"Trainer": ".loop"}  # torch + transformers

__all__ = [
    "DEVICES",
    "LOSS_AGGS",
    "MULTI_TURN",
    "PAUSE_MODES",
    "STALE_POLICIES",
    "CheckpointError",
    "DistributedError",
    "PublisherFactory",
    "SyncConfig",
    "Trainer",
    "TrainerConfig",
    "TrainerConfigError",
    "TrainerError",
    "WeightStore",
    "WeightSyncer",
    "WeightsError",
    "default_weights_dir",
    "plot_metrics",
    "read_metrics",
    "run_sync",
    "run_trainer",
    "store_publisher",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
