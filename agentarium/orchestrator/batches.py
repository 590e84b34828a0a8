"""One batch at a time: rows expanded into jobs (``group_size`` each) and published, waited
for, its trajectories collected in job order, then forgotten (``reset``)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import structlog

from agentarium.schemas import Sampling, Trajectory, check_name

from ..progress import ProgressBar
from .batch_data import batch_id_for, expand, normalize
from .config import OrchestratorConfig
from .runtime import Runtime

log = structlog.get_logger("agentarium.orchestrator")


@dataclass
class BatchState:
    """The batch between ``initialize_batch_processing`` and ``reset_orchestrator_state``."""

    batch_id: str
    is_train: bool
    job_ids: list[str]
    published: int
    duplicates: int
    started: float = field(default_factory=time.monotonic)
    waited_s: float = 0.0
    complete: bool = False


class Batches:
    """The loaded batch (``current``), its submission, waiting and trajectories."""

    def __init__(self, config: OrchestratorConfig, runtime: Runtime) -> None:
        self.config = config
        self.runtime = runtime
        self.loaded: BatchState | None = None
        self._sequence = 0  # batches submitted: part of the next derived batch id
        self._progress = ProgressBar(0, enabled=False)

    def submit(
        self,
        data: Any,
        is_train: bool,
        *,
        agents: Mapping[str, Any],
        agent: str | None,
        group_size: int | None,
        batch_id: str | None,
        sampling: Sampling | Mapping[str, Any] | None,
        metadata: Mapping[str, Any] | None,
        deadline_s: float | None,
        progress: bool | None,
    ) -> BatchState:
        """See ``AgentOrchestrator.initialize_batch_processing``; ``agents``: the registered
        ones, which rows may name."""
        if self.loaded is not None:
            raise RuntimeError(
                f"batch {self.loaded.batch_id} is still loaded: call reset_orchestrator_state() "
                "before initialize_batch_processing()"
            )
        cfg = self.config
        default = agent or cfg.default_agent or (next(iter(agents)) if len(agents) == 1 else None)
        rows = normalize(data, registered=agents, default_agent=default)
        size = group_size or (cfg.group_size if is_train else cfg.val_group_size)
        if batch_id is None:
            batch_id = batch_id_for(cfg.run, self._sequence, rows, size, is_train)
        else:
            check_name(batch_id, "batch_id")
        if isinstance(sampling, Mapping):
            sampling = Sampling(**sampling)
        jobs = expand(
            rows,
            run=cfg.run,
            batch_id=batch_id,
            group_size=size,
            is_train=is_train,
            sampling=sampling or cfg.sampling,
            deadline_s=deadline_s or cfg.deadline_s,
            metadata=metadata,
        )
        self._progress = ProgressBar(len(jobs), enabled=progress)
        published, duplicates = self.runtime.loop.call(
            self.runtime.core.submit(jobs, self._progress.update)
        )
        self._sequence += 1
        self.loaded = BatchState(
            batch_id, is_train, [j.job_id for j in jobs], published, duplicates
        )
        log.info(
            "batch submitted",
            run=cfg.run,
            batch_id=batch_id,
            jobs=len(jobs),
            rows=len(rows),
            group_size=size,
            is_train=is_train,
            duplicates=duplicates,
        )
        return self.loaded

    @property
    def current(self) -> BatchState:
        if self.loaded is None:
            raise RuntimeError(
                "no batch is loaded: call initialize_batch_processing(data, is_train) first"
            )
        return self.loaded

    def wait(self, timeout: float | None) -> dict[str, int]:
        """Every job's trajectory, or TimeoutError; the status counts."""
        batch = self.current
        started = time.monotonic()
        try:
            self.runtime.loop.call(self.runtime.core.wait(timeout))
            batch.complete = True
        finally:
            batch.waited_s += time.monotonic() - started
            self._progress.close()
        return self.status_counts()

    def status_counts(self) -> dict[str, int]:
        counts = {"jobs": len(self.current.job_ids), "ok": 0, "error": 0, "timeout": 0}
        for trajectory in self.trajectories():
            counts[trajectory.status] += 1
        return counts

    def trajectories(self) -> list[Trajectory]:
        """The current batch's trajectories that have arrived, in job order."""
        batch = self.current
        results = self.runtime.core.feed.results
        return [results[j] for j in batch.job_ids if j in results]

    def reset(self) -> None:
        self.loaded = None
        self.runtime.soon(self.runtime.core.clear)
