"""The orchestrator's Ray CPU checks as pure decisions: which ray_config is refused up front,
and when a waiting batch is a stall (an error, or a warning) rather than a scheduling delay.
The same checks on a real Ray cluster: tests/test_ray_agents.py."""

from __future__ import annotations

import math

import pytest

from agentarium.orchestrator.ray_resources import (
    AgentTasksUnschedulable,
    Snapshot,
    StallWatch,
    check_fits,
    task_cpus,
)


def fits(**kw):
    args = dict(
        cluster_cpus=2.0,
        actor_cpus=0.0,
        new_actors=1,
        cpus_per_actor=1.0,
        agent="calc",
        agent_task_cpus=0.1,
    )
    check_fits(**{**args, **kw})


def test_actors_that_leave_no_cpu_for_agent_tasks_are_refused_in_words():
    fits()  # 1 CPU left for 0.1-CPU tasks
    with pytest.raises(ValueError) as refused:
        fits(cpus_per_actor=2.0)
    message = str(refused.value)
    assert "Ray task needing 0.1 CPU" in message and "hold 2 of the Ray cluster's 2 CPU" in message
    assert "leaving 0" in message and "lower ray_config num_cpus" in message
    with pytest.raises(ValueError, match="held by earlier ones"):  # every agent's actors count
        fits(actor_cpus=1.5, cpus_per_actor=1.0)
    with pytest.raises(ValueError, match="leaving 0.05"):
        fits(new_actors=2, cpus_per_actor=0.975)


def test_actors_of_a_plain_agent_may_take_every_cpu_but_not_more():
    fits(cpus_per_actor=2.0, agent_task_cpus=None)  # the agent runs inside the actor
    with pytest.raises(ValueError, match="the actors would never start"):
        fits(new_actors=3, cpus_per_actor=1.0, agent_task_cpus=None)


def test_task_cpus_reads_the_decorator_or_ray_default():
    ray = pytest.importorskip("ray")

    @ray.remote(num_cpus=0.25)
    def light(task, endpoint, model):
        return 0.0

    @ray.remote
    def plain(task, endpoint, model):
        return 0.0

    assert task_cpus(light) == 0.25 and task_cpus(plain) == 1.0


def snap(free: float, pending: int = 4, smallest: float = 0.1, cluster: float = 2.0) -> Snapshot:
    return Snapshot(
        cluster_cpus=cluster,
        free_cpus=free,
        pending_cpu_tasks=pending,
        smallest_pending_cpus=smallest if pending else math.inf,
    )


def observe(watch, s, t, missing=8, actor_cpus=2.0):
    return watch.observe(s, missing=missing, actor_cpus=actor_cpus, agents={"calc": 0.1}, now=t)


def test_pending_tasks_behind_the_actors_own_cpus_are_an_error_after_the_grace():
    watch = StallWatch(stall_after_s=3)
    assert observe(watch, snap(free=0), 0.0) is None
    assert observe(watch, snap(free=0), 2.0) is None  # could still be a scheduling delay
    with pytest.raises(AgentTasksUnschedulable) as stalled:
        observe(watch, snap(free=0), 3.5)
    message = str(stalled.value)
    assert "cannot be scheduled" in message and "4 Ray task(s) wait for a CPU" in message
    assert "0 of 2 CPU free, the consumer actors hold 2" in message
    assert "8 trajectories missing" in message


def test_a_cpu_held_by_something_else_is_one_warning_per_stall():
    watch = StallWatch(stall_after_s=3)
    for t in (0.0, 1.0, 2.0):
        assert observe(watch, snap(free=0), t, actor_cpus=0.1) is None
    warning = observe(watch, snap(free=0), 3.0, actor_cpus=0.1)
    assert warning and "other tasks and actors 1.9" in warning
    assert observe(watch, snap(free=0), 4.0, actor_cpus=0.1) is None  # said once
    assert observe(watch, snap(free=0.5), 5.0, actor_cpus=0.1) is None  # a CPU came free
    for t in (6.0, 7.0, 8.0):
        observe(watch, snap(free=0), t, actor_cpus=0.1)
    assert observe(watch, snap(free=0), 9.0, actor_cpus=0.1)  # a new stall: a new warning


def test_progress_free_cpu_or_nothing_pending_is_no_stall():
    watch = StallWatch(stall_after_s=3)
    for t, missing in ((0.0, 8), (2.0, 8), (4.0, 7), (5.0, 7)):  # a trajectory arrived at 4 s
        assert observe(watch, snap(free=0), t, missing=missing, actor_cpus=0.1) is None
    watch = StallWatch(stall_after_s=0)
    assert observe(watch, snap(free=0.1), 0.0) is None  # room for the smallest task
    assert observe(watch, snap(free=0, pending=0), 1.0) is None  # nothing waits for a CPU
    assert observe(watch, None, 2.0) is None  # Ray cannot say
    assert observe(watch, snap(free=0), 3.0, missing=0) is None  # nothing missing
