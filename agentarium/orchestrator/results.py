"""A batch's trajectories as what the trainer takes: padded tensors with the GRPO
advantages and the batch's metrics (``training_batch``), or the metrics alone
(``validation_metrics``)."""

from __future__ import annotations

from typing import Any

from agentarium.schemas import Trajectory

from ..agent_metrics import agent_metrics
from .batches import BatchState
from .tensorize import TrainingBatch, tensorize


def training_batch(
    batch: BatchState,
    trajectories: list[Trajectory],
    *,
    run: str,
    success_threshold: float,
    **tensorize_options: Any,
) -> tuple[TrainingBatch, dict[str, float]]:
    """``tensorize(trajectories, **tensorize_options)``, its counts merged into the agent
    metrics, plus what is missing and how long the batch was waited for."""
    tensors, counts = tensorize(trajectories, **tensorize_options)
    metrics = agent_metrics(trajectories, success_threshold=success_threshold)
    metrics.update(counts)
    metrics["batch/missing"] = float(len(batch.job_ids) - len(trajectories))
    metrics["batch/wait_s"] = batch.waited_s
    tensors.meta_info.update(run=run, batch_id=batch.batch_id)
    return tensors, metrics


def validation_metrics(
    batch: BatchState, trajectories: list[Trajectory], *, success_threshold: float
) -> dict[str, float]:
    metrics = agent_metrics(trajectories, success_threshold=success_threshold)
    metrics["overall/missing"] = float(len(batch.job_ids) - len(trajectories))
    return metrics
