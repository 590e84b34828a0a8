"""Whether agents' Ray tasks can get a CPU: refused up front when the orchestrator's own
consumer actors would hold every CPU, and watched while a batch waits.

An agent written as a Ray remote function (``@ray.remote(num_cpus=0.1)``) runs each rollout
as a Ray task, scheduled beside the consumer actors that call it. When the actors hold every
CPU of the cluster (``ray_config={"num_cpus": 2}`` on a 2-CPU cluster), the tasks stay
pending for ever and the batch waits with no sign of why. Two checks:

- before the actors start (``check_fits``): the actors' CPUs against the cluster's, read
  from ``ray.cluster_resources()``. Skipped with ``ray_config={"check_resources": False}``
  (an autoscaling cluster, whose CPUs are not all there yet);
- while a batch waits (``StallWatch``): tasks pending (the resource demand Ray's autoscaler
  reads from the GCS), no trajectory arriving, and no CPU free for them. When only the
  consumer actors hold CPUs, nothing can ever run: an error. When something else holds them
  (other tasks, other actors, the agents' own long rollouts), a warning once per episode.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger("agentarium.ray")

RAY_TASK_DEFAULT_CPUS = 1.0  # what Ray gives a task whose decorator names no num_cpus
STALL_AFTER_S = 3.0  # pending with no progress this long is a stall, not a scheduling delay


class AgentTasksUnschedulable(RuntimeError):
    """Agent tasks wait for CPUs that the orchestrator's own actors hold."""


def task_cpus(fn: Any) -> float:
    """CPUs one call of a Ray remote function asks for (its decorator's ``num_cpus``)."""
    options = getattr(fn, "_default_options", None) or {}
    value = options.get("num_cpus")
    return RAY_TASK_DEFAULT_CPUS if value is None else float(value)


def _cpus(value: float) -> str:
    return f"{value:g}"


def check_fits(
    *,
    cluster_cpus: float,
    actor_cpus: float,
    new_actors: int,
    cpus_per_actor: float,
    agent: str,
    agent_task_cpus: float | None,
) -> None:
    """Refuse (ValueError, in words) actors that do not fit, or that leave no CPU for one of
    the agent's tasks. ``actor_cpus``: what the actors already started hold; ``agent_task_cpus``
    None for an agent that is not a Ray remote function (it runs inside the actor)."""
    wanted = new_actors * cpus_per_actor
    held = actor_cpus + wanted
    fix = (
        "lower ray_config num_cpus (a consumer actor mostly waits on the LLM: 0.1-0.5 is "
        "plenty) or num_actors, or give Ray more CPUs (ray.init(num_cpus=...)); "
        'ray_config={"check_resources": False} skips this check on an autoscaling cluster'
    )
    if held > cluster_cpus + 1e-9:
        raise ValueError(
            f"agent {agent!r}: ray_config asks for {new_actors} consumer actor(s) x "
            f"{_cpus(cpus_per_actor)} CPU = {_cpus(wanted)} CPU"
            + (f" on top of the {_cpus(actor_cpus)} CPU held by earlier ones" if actor_cpus else "")
            + f", but the Ray cluster has {_cpus(cluster_cpus)} CPU: the actors would never "
            f"start. {fix}"
        )
    if agent_task_cpus is not None and cluster_cpus - held < agent_task_cpus - 1e-9:
        raise ValueError(
            f"agent {agent!r} runs each rollout as a Ray task needing {_cpus(agent_task_cpus)} "
            f"CPU, but the consumer actors would hold {_cpus(held)} of the Ray cluster's "
            f"{_cpus(cluster_cpus)} CPU, leaving {_cpus(max(0.0, cluster_cpus - held))}: no "
            f"rollout could ever be scheduled. {fix}"
        )


@dataclass(frozen=True)
class Snapshot:
    """The cluster as one check sees it."""

    cluster_cpus: float
    free_cpus: float
    pending_cpu_tasks: int  # pending task/actor requests that need a CPU
    smallest_pending_cpus: float  # the least CPU one of them asks for (inf: none pending)


def read_snapshot() -> Snapshot | None:
    """From the running Ray session; None when Ray cannot say (not initialised, or the
    GCS resource-demand call is missing in this Ray version)."""
    import ray

    if not ray.is_initialized():
        return None
    try:
        from ray.autoscaler.v2.sdk import get_cluster_status

        status = get_cluster_status(ray.get_runtime_context().gcs_address)
        demands = status.resource_demands.ray_task_actor_demand
    except Exception:  # noqa: BLE001 - an internal API: without it, no run-time diagnosis
        return None
    count, smallest = 0, math.inf
    for demand in demands:
        for request in demand.bundles_by_count:
            cpus = float(request.bundle.get("CPU", 0.0))
            if cpus > 0:
                count += request.count
                smallest = min(smallest, cpus)
    return Snapshot(
        cluster_cpus=float(ray.cluster_resources().get("CPU", 0.0)),
        free_cpus=float(ray.available_resources().get("CPU", 0.0)),
        pending_cpu_tasks=count,
        smallest_pending_cpus=smallest,
    )


class StallWatch:
    """Fed one snapshot per check with the number of trajectories still missing; says when
    agent tasks cannot be scheduled. ``actor_cpus``: what the orchestrator's actors hold."""

    def __init__(self, *, stall_after_s: float = STALL_AFTER_S) -> None:
        self.stall_after_s = stall_after_s
        self._since: float | None = None  # when the current stall was first seen
        self._missing: int | None = None
        self._warned = False

    def observe(
        self,
        snap: Snapshot | None,
        *,
        missing: int,
        actor_cpus: float,
        agents: Mapping[str, float],
        now: float | None = None,
    ) -> str | None:
        """A warning to log (once per stall), or None; raises AgentTasksUnschedulable when
        the orchestrator's own actors hold every CPU the tasks need."""
        now = time.monotonic() if now is None else now
        progressed = self._missing is not None and missing < self._missing
        self._missing = missing
        stuck = (
            snap is not None
            and missing > 0
            and not progressed
            and snap.pending_cpu_tasks > 0
            and snap.free_cpus < snap.smallest_pending_cpus - 1e-9
        )
        if not stuck:
            self._since = None
            self._warned = False
            return None
        assert snap is not None
        if self._since is None:
            self._since = now
        if now - self._since < self.stall_after_s:
            return None
        others = max(0.0, snap.cluster_cpus - snap.free_cpus - actor_cpus)
        needs = ", ".join(f"{name!r} {_cpus(c)} CPU" for name, c in sorted(agents.items()))
        state = (
            f"{snap.pending_cpu_tasks} Ray task(s) wait for a CPU ({needs or 'agent tasks'} "
            f"each) and no trajectory arrived for {now - self._since:.0f}s: the Ray cluster has "
            f"{_cpus(snap.free_cpus)} of {_cpus(snap.cluster_cpus)} CPU free, the consumer "
            f"actors hold {_cpus(actor_cpus)}"
        )
        if others < snap.smallest_pending_cpus - 1e-9:
            raise AgentTasksUnschedulable(
                f"agent tasks cannot be scheduled: {state} and nothing else runs, so none "
                f"ever will; {missing} trajectories missing. Lower ray_config num_cpus (or "
                "num_actors), or give Ray more CPUs"
            )
        if self._warned:
            return None
        self._warned = True
        return (
            f"{state}, other tasks and actors {_cpus(others)}: the agents' tasks run once "
            "those free a CPU (if they are this batch's own long rollouts, all is well)"
        )
