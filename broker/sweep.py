"""Sweep stranded jobs: what ``agentarium broker sweep`` does.

A job is *stranded* when it is still in the TASKS work-queue stream but its agent's
``rollout-<agent>`` consumer will never deliver it again: its stream sequence is at or below
the consumer's ack floor. Two ways lead there:

- a consumer made by hand with a smaller ``max_deliver`` gave up on it (our workers dead-letter
  and terminate a job on its last delivery, which removes it);
- an older nats-server in a cluster can keep messages of a work-queue stream whose consumer
  acked them across a leader change (seen on 2.9.10 after a SIGKILL of the TASKS leader: 191 of
  2,048; related upstream reports: nats-io/nats-server#3953; 2.11 changed clustered removals
  to proposals from the consumer leader, nats-io/nats-server#6140). Nothing is redelivered,
  but the jobs keep their room in the queue, so a queue with a message limit fills with jobs
  already done.

The sweep reads each stranded job and deletes it only when its trajectory is stored: that job
is done, and removing it loses nothing. Any other stranded job is kept and listed (it may
never have run: re-publish it, or read ``AGENTARIUM_DEAD`` for it).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext

from agentarium.schemas import Job, SchemaError, decode

from .topology import Topology

# How many kept job ids a report lists (the count is always exact).
LIST_KEPT = 20


@dataclass
class SweepReport:
    """One agent's sweep: stranded jobs found, removed (trajectory stored), kept."""

    agent: str
    dry_run: bool = False  # then ``removed`` counts what would have been removed
    ack_floor: int = 0  # the consumer's ack floor (stream sequence) the sweep read up to
    stranded: int = 0
    removed: int = 0
    already_gone: int = 0  # removed by the server between the read and the delete
    kept: int = 0
    kept_jobs: list[str] = field(default_factory=list)  # the first LIST_KEPT, "job_id (why)"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def sweep_stranded(
    js: JetStreamContext,
    topo: Topology,
    *,
    agents: tuple[str, ...] = (),
    dry_run: bool = False,
) -> list[SweepReport]:
    """Delete every stranded job whose trajectory is stored, for each agent with a
    ``rollout-<agent>`` consumer (or only ``agents``). ``dry_run`` deletes nothing and reports
    what would go. Jobs above the ack floor (waiting or in flight) are never deleted: the walk
    stops at the first of them."""
    floors = {}
    for info in await js.consumers_info(topo.tasks_stream):
        if (agent := topo.agent_of_rollout_consumer(info.name)) is not None:
            floors[agent] = int(info.ack_floor.stream_seq or 0) if info.ack_floor else 0
    missing = set(agents) - set(floors)
    if missing:  # before anything is deleted
        raise ValueError(
            f"no rollout consumer for agent(s) {', '.join(sorted(missing))} on "
            f"{topo.tasks_stream}: nothing of theirs can be stranded"
        )
    return [
        await _sweep_agent(js, topo, agent, floors[agent], dry_run)
        for agent in sorted(agents or floors)
    ]


async def _sweep_agent(
    js: JetStreamContext, topo: Topology, agent: str, floor: int, dry_run: bool
) -> SweepReport:
    report = SweepReport(agent=agent, dry_run=dry_run, ack_floor=floor)
    subject = topo.tasks_subject(agent)
    seq = 1
    while seq <= floor:
        try:
            msg = await js.get_msg(topo.tasks_stream, seq, subject=subject, next=True)
        except nats.js.errors.NotFoundError:
            break  # no message of this agent from seq on
        if msg.seq is None or msg.seq > floor:
            break
        seq = msg.seq + 1
        report.stranded += 1
        why = await _not_done(js, topo, agent, msg.seq, msg.data or b"", msg.headers)
        if why:
            report.kept += 1
            if len(report.kept_jobs) < LIST_KEPT:
                report.kept_jobs.append(why)
            continue
        if dry_run:
            report.removed += 1
            continue
        try:
            await js.delete_msg(topo.tasks_stream, msg.seq)
            report.removed += 1
        except nats.js.errors.NotFoundError:
            report.already_gone += 1
    return report


async def _not_done(
    js: JetStreamContext, topo: Topology, agent: str, seq: int, data: bytes, headers: dict | None
) -> str:
    """Why a stranded job must stay ("" when its trajectory is stored)."""
    try:
        job = decode(Job, data, (headers or {}).get("Content-Type"))
        stored = await trajectory_stored(js, topo, job.run, agent, job.job_id)
    except (SchemaError, ValueError) as exc:
        return f"seq {seq} (undecodable: {str(exc)[:80]})"
    return "" if stored else f"{job.job_id} (seq {seq}, no trajectory stored)"


async def trajectory_stored(
    js: JetStreamContext, topo: Topology, run: str, agent: str, job_id: str
) -> bool:
    """Whether a job's trajectory is stored: one last-message lookup on its own subject."""
    try:
        await js.get_last_msg(topo.trajectories_stream, topo.trajectory_subject(run, agent, job_id))
    except nats.js.errors.NotFoundError:
        return False
    return True


def format_sweep(reports: list[SweepReport]) -> str:
    if not reports:
        return "no rollout consumers: nothing is stranded"
    verb = "would remove" if reports[0].dry_run else "removed"
    lines = [f"{'agent':<20} {'ack floor':>10} {'stranded':>8} {verb:>12} {'kept':>6}"]
    for r in reports:
        removed = r.removed + r.already_gone
        lines.append(f"{r.agent:<20} {r.ack_floor:>10} {r.stranded:>8} {removed:>12} {r.kept:>6}")
    for r in reports:
        if r.kept:
            more = f" (and {r.kept - len(r.kept_jobs)} more)" if r.kept > len(r.kept_jobs) else ""
            lines.append(
                f"agent {r.agent}: kept {r.kept} stranded job(s) with no trajectory stored (or "
                "undecodable): they may never have run; re-publish them or look for them in the "
                "dead letters: " + ", ".join(r.kept_jobs) + more
            )
    return "\n".join(lines)
