"""Trajectories for trainer tests: groups of 4 one-call trajectories on the tiny model's
byte-level tokens, published where a trainer reads them."""

from __future__ import annotations

from collections.abc import Callable

from schemas import LLMCall, Trajectory, encode


def one_call_group(
    g: int,
    *,
    run: str,
    agent: str,
    job_id: Callable[[int, int], str],
    group_id: str,
    reward: Callable[[int, int], float],
    version: str = "default",
    trace: bool = False,
) -> list[Trajectory]:
    """Group ``g``: 4 members whose reply is digit ``i``, scored by ``reward(g, i)``."""
    out = []
    for i in range(4):
        call = LLMCall(
            prompt_ids=[257, 48 + g, 258],
            response_ids=[48 + i, 258],
            response_logprobs=[-5.5, -5.6],
            finish_reason="stop",
            weight_version=version,
        )
        out.append(
            Trajectory(
                job_id=job_id(g, i),
                agent=agent,
                task_id=f"t{g}",
                group_id=group_id,
                group_size=4,
                run=run,
                status="ok",
                reward=reward(g, i),
                calls=[call],
                trace_id=f"{g + 1:016x}{i + 1:016x}" if trace else "",
            )
        )
    return out


async def publish(js, topology, trajectories: list[Trajectory]) -> None:
    for traj in trajectories:
        subject = topology.trajectory_subject(traj.run, traj.agent, traj.job_id)
        await js.publish(subject, encode(traj))
