"""The asynchronous GRPO trainer: collector, GRPO math, step, checkpoints, metrics and
experiment trackers, and weight publishing and streaming (see docs/design.md, "The trainer"; the weight syncer
is inference.sync).

``import agentarium.trainer`` stays light (no torch): the names that need torch load on first use. The
torch-free trajectory -> token rows rules (trainer/rows.py) are shared with the verl tensorizer
and export.
"""

from __future__ import annotations

import importlib
from typing import Any

from .app import PublisherFactory, run_trainer, store_publisher
from .config import (
    DEVICES,
    LOSS_AGGS,
    OPTIMIZER_STATES,
    STALE_POLICIES,
    TASK_ADV_NORMS,
    TrainerConfig,
)
from .errors import (
    CheckpointError,
    DistributedError,
    TrackerError,
    TrainerConfigError,
    TrainerError,
)
from .heap import ALLOCATORS, TRAINER_MALLOC_ENV, allocator_env, use_allocator
from .memory import MEMORY_PLANS
from .metrics import plot_metrics, read_metrics, step_figure
from .process import TrainerProcess, allocator_for, publisher_for
from .rows import (
    HOW,
    MULTI_TURN,
    TokenRow,
    call_refusal,
    grpo_advantages,
    pad_token_id,
    refusal,
    rows_of,
)
from .trackers import TRACKERS
from .weight_stream import WEIGHT_TRANSPORTS, StreamConfig, stream_publisher
from .weights import WeightsError, WeightStore

_LAZY = {  # torch + transformers
    "Trainer": ".loop",
    "merge_lora": ".lora",
    "peft_adapter": ".lora",
}

__all__ = [
    "ALLOCATORS",
    "MEMORY_PLANS",
    "TRAINER_MALLOC_ENV",
    "allocator_env",
    "allocator_for",
    "use_allocator",
    "DEVICES",
    "OPTIMIZER_STATES",
    "HOW",
    "LOSS_AGGS",
    "MULTI_TURN",
    "STALE_POLICIES",
    "TASK_ADV_NORMS",
    "TRACKERS",
    "WEIGHT_TRANSPORTS",
    "CheckpointError",
    "DistributedError",
    "PublisherFactory",
    "StreamConfig",
    "TokenRow",
    "TrackerError",
    "Trainer",
    "TrainerConfig",
    "TrainerConfigError",
    "TrainerError",
    "TrainerProcess",
    "WeightStore",
    "WeightsError",
    "call_refusal",
    "grpo_advantages",
    "merge_lora",
    "pad_token_id",
    "peft_adapter",
    "plot_metrics",
    "publisher_for",
    "read_metrics",
    "refusal",
    "rows_of",
    "run_trainer",
    "step_figure",
    "store_publisher",
    "stream_publisher",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
