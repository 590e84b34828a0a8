"""Trainer errors, grouped by what the caller should do.

TrainerError            root of every error raised by ``trainer``
├── TrainerConfigError  a setting is out of range or inconsistent: fix the flag (a ValueError,
│                       so the CLI reports it like any other bad input)
├── CheckpointError     a checkpoint cannot be read or written: fix the directory, or start
│                       without --resume
├── TrackerError        an experiment tracker could not start (trainer/trackers.py): fix its
│                       environment (WANDB_MODE, MLFLOW_TRACKING_URI) or drop it from --report-to
└── DistributedError    the data-parallel workers (Ray, torch.distributed) failed to start
                        or to step: fix the cluster, or run with --ray-workers 0

Trajectories that cannot be trained on (sampled with top_p < 1, top_k > 0 or greedily) are not
errors: the collector drops and counts them, since one bad producer must not stop a trainer.
"""

from __future__ import annotations


class TrainerError(Exception):
    """Root of every error raised by ``trainer``."""


class TrainerConfigError(TrainerError, ValueError):
    """A trainer setting is invalid; the message names the flag and the allowed values."""


class CheckpointError(TrainerError):
    """A checkpoint directory is unreadable, incomplete or was written for another run."""


class DistributedError(TrainerError):
    """Data-parallel workers could not start, or one of them failed during a step."""


class TrackerError(TrainerError):
    """An experiment tracker could not start (a bad W&B mode or key, an unreachable MLflow)."""
