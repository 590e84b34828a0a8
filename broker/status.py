"""Queue status: what ``agentarium broker status`` shows.

Waiting jobs come from the TASKS stream's per-subject message counts, not the consumer's
``num_pending``: a job that exhausted its deliveries stays in a work-queue stream but is
no longer pending for the consumer; the difference is reported as *stranded*. Jobs of an agent
whose ``rollout-<agent>`` consumer does not exist yet are only waiting: the consumer, once a
worker creates it, delivers them.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from typing import Any

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .env_status import EnvServiceStatus, collect_env_status, format_env_status
from .registry import live_workers
from .topology import Topology

# Above this many trajectories, runs are not discovered from the per-subject map (one
# entry per job); name them with --run to count them exactly.
SUBJECT_MAP_LIMIT = 200_000


@dataclass
class AgentStatus:
    agent: str
    waiting: int = 0
    pending: int = 0
    in_flight: int = 0
    redelivered: int = 0
    dead_lettered: int = 0
    stranded: int = 0
    has_consumer: bool = False
    workers: int = 0
    rollouts_per_s: float = 0.0  # the live workers' rates over their last registry interval
    fleet_down: int = 0  # live workers whose LLM fleet is down (they pull nothing meanwhile)


@dataclass
class BrokerStatus:
    agents: list[AgentStatus] = field(default_factory=list)
    trajectories: dict[str, int] = field(default_factory=dict)
    workers: list[dict[str, Any]] = field(default_factory=list)
    policy: dict[str, Any] = field(default_factory=dict)
    # run -> the trainer's latest metrics row (<p>.metrics.<run>), per-task columns included
    trainer: dict[str, dict[str, Any]] = field(default_factory=dict)
    tasks_total: int = 0
    tasks_bytes: int = 0
    notes: list[str] = field(default_factory=list)
    # environment services ($SRV.STATS): one row per environment, its workers inside
    environments: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


async def count_messages(js: JetStreamContext, stream: str, subject_filter: str) -> int:
    """Exact message count under a filter, via a short-lived consumer (no per-subject map)."""
    name = f"count-{uuid.uuid4().hex[:12]}"
    config = ConsumerConfig(
        name=name,
        durable_name=name,
        filter_subject=subject_filter,
        deliver_policy=DeliverPolicy.ALL,
        ack_policy=AckPolicy.NONE,
        inactive_threshold=30.0,
    )
    info = await js.add_consumer(stream, config)
    try:
        return int(info.num_pending or 0)
    finally:
        try:
            await js.delete_consumer(stream, name)
        except nats.js.errors.Error:
            pass  # inactive_threshold removes it anyway


async def _subject_counts(
    js: JetStreamContext, stream: str, subjects_filter: str
) -> dict[str, int]:
    try:
        info = await js.stream_info(stream, subjects_filter=subjects_filter)
    except nats.js.errors.NotFoundError:
        return {}
    return dict(info.state.subjects or {})


async def collect_status(
    js: JetStreamContext,
    topo: Topology,
    *,
    runs: tuple[str, ...] = (),
    environments: bool = True,
) -> BrokerStatus:
    status = BrokerStatus()
    if environments:
        # $SRV requests are core NATS: nats-py keeps no public handle on a context's connection
        envs = await collect_env_status(js._nc, topo)  # type: ignore[attr-defined]
        status.environments = [e.to_json() for e in envs]
    try:
        tasks = await js.stream_info(topo.tasks_stream, subjects_filter=f"{topo.prefix}.tasks.>")
    except nats.js.errors.NotFoundError:
        status.notes.append(
            f"stream {topo.tasks_stream} does not exist: run `agentarium broker init`"
        )
        return status
    status.tasks_total = tasks.state.messages
    status.tasks_bytes = tasks.state.bytes
    per_agent: dict[str, AgentStatus] = {}

    def agent(name: str) -> AgentStatus:
        return per_agent.setdefault(name, AgentStatus(agent=name))

    for subject, count in (tasks.state.subjects or {}).items():
        agent(topo.agent_of_subject(subject)).waiting = count
    for subject, count in (
        await _subject_counts(js, topo.dead_stream, f"{topo.prefix}.dead.>")
    ).items():
        agent(subject.rsplit(".", 1)[-1]).dead_lettered = count
    for info in await js.consumers_info(topo.tasks_stream):
        name = topo.agent_of_rollout_consumer(info.name)
        if name is None:
            continue
        row = agent(name)
        row.has_consumer = True
        row.pending = info.num_pending or 0
        row.in_flight = info.num_ack_pending or 0
        row.redelivered = info.num_redelivered or 0
    for row in per_agent.values():
        if row.has_consumer:
            row.stranded = max(0, row.waiting - row.pending - row.in_flight)
            if row.stranded:
                status.notes.append(
                    f"agent {row.agent}: {row.stranded} stranded jobs (in the queue, never to be "
                    f"delivered again): `agentarium broker sweep --agent {row.agent}` removes "
                    "those whose trajectory is stored and lists the rest"
                )
        elif row.waiting:
            status.notes.append(
                f"agent {row.agent}: {row.waiting} jobs wait for their first consumer "
                f"(rollout-{row.agent} does not exist yet): start "
                f"`agentarium consumer --agent {row.agent}=module:function`"
            )
    status.agents = sorted(per_agent.values(), key=lambda a: a.agent)

    traj = await js.stream_info(topo.trajectories_stream)
    if runs:
        for run in runs:
            status.trajectories[run] = await count_messages(
                js, topo.trajectories_stream, topo.trajectories_filter(run)
            )
    elif traj.state.messages <= SUBJECT_MAP_LIMIT:
        for subject, count in (
            await _subject_counts(js, topo.trajectories_stream, topo.trajectories_filter())
        ).items():
            run = subject.split(".")[2]
            status.trajectories[run] = status.trajectories.get(run, 0) + count
    else:
        status.notes.append(
            f"{traj.state.messages} trajectories stored: pass --run RUN for per-run counts"
        )

    try:
        status.workers = await live_workers(js, topo)
    except nats.js.errors.NotFoundError:  # streams only: made by a producer, which needs no more
        status.notes.append(
            f"bucket {topo.workers_bucket} does not exist (a producer creates only the streams): "
            "run `agentarium broker init`, or start a consumer, which creates what it needs"
        )
    for worker in status.workers:
        served = per_agent.get(worker.get("agent", ""))
        if served is not None:
            served.workers += 1
            served.rollouts_per_s = round(
                served.rollouts_per_s + float(worker.get("rollouts_per_s", 0.0)), 2
            )
            if (worker.get("fleet") or {}).get("state") == "down":
                served.fleet_down += 1
    for row in status.agents:
        if row.fleet_down:
            status.notes.append(fleet_note(row, status.workers))
    try:
        kv = await js.key_value(topo.policy_bucket)
        for key in await kv.keys():
            entry = await kv.get(key)
            if entry.value:
                status.policy[key] = json.loads(entry.value)
    except nats.js.errors.NoKeysError:
        pass
    except nats.js.errors.NotFoundError:
        status.notes.append(
            f"bucket {topo.policy_bucket} does not exist: run `agentarium broker init`"
        )
    for run in sorted(set(runs) | set(status.trajectories) | set(status.policy)):
        latest = await _latest_metrics(js, topo, run)
        if latest is not None:
            status.trainer[run] = latest
    return status


async def _latest_metrics(js: JetStreamContext, topo: Topology, run: str) -> dict | None:
    """The trainer's last step row for ``run``, or None (no trainer, no metrics stream, or a
    name the subject cannot hold)."""
    try:
        raw = await js.get_last_msg(topo.metrics_stream, topo.metrics_subject(run))
        row = json.loads(raw.data or b"null")
    except (nats.js.errors.NotFoundError, ValueError):
        return None
    except TimeoutError:  # also how a user without permission to read the stream is refused
        return None
    return row if isinstance(row, dict) else None


def fleet_note(row: AgentStatus, workers: list[dict[str, Any]]) -> str:
    """What an agent's workers say of an LLM fleet outage."""
    down = [
        w["fleet"]
        for w in workers
        if w.get("agent") == row.agent and (w.get("fleet") or {}).get("state") == "down"
    ]
    longest = max(float(f.get("down_for_s", 0.0)) for f in down)
    if any(f.get("past_limit") for f in down):
        effect = "past the outage limit: their rollouts fail as errors until it answers"
    else:
        effect = "they pull no jobs and hold their rollouts until it answers"
    return (
        f"agent {row.agent}: LLM fleet down on {len(down)} of {row.workers} worker(s), for "
        f"{longest:.0f}s: {effect}"
    )


def _fleet_cell(worker: dict[str, Any]) -> str:
    fleet = worker.get("fleet")
    if not fleet:
        return ""
    servers = f"{fleet.get('servers_down', 0)}/{fleet.get('servers', 0)} servers down"
    if fleet.get("state") != "down":
        return f" llm=up ({servers})" if fleet.get("servers_down") else " llm=up"
    past = ", past limit" if fleet.get("past_limit") else ""
    return f" llm=DOWN {float(fleet.get('down_for_s', 0.0)):.0f}s ({servers}{past})"


TASK_COLUMNS = (
    "reward_mean_received",
    "success",
    "length",
    "dropped_stale",
    "dropped_groups",
)


def _tasks_of(row: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{agent: {column: value}}`` from a row's ``<column>/<agent>`` cells."""
    tasks: dict[str, dict[str, Any]] = {}
    for key, value in row.items():
        column, sep, agent = key.partition("/")
        if sep and column in TASK_COLUMNS:
            tasks.setdefault(agent, {})[column] = value
    return tasks


def _cell(value: Any, width: int) -> str:
    if value is None or value == "":
        return f"{'-':>{width}}"
    if isinstance(value, float):
        return f"{value:>{width}.3f}"
    return f"{value:>{width}}"


def format_status(status: BrokerStatus) -> str:
    lines = [
        f"{'agent':<20} {'waiting':>8} {'in flight':>9} {'redelivered':>11} {'dead':>6} {'stranded':>8}"
        f" {'workers':>7} {'rollouts/s':>10}",
    ]
    for a in status.agents:
        # no consumer yet: nothing is in flight or stranded, the jobs wait for the first one
        stranded = a.stranded if a.has_consumer else "-"
        lines.append(
            f"{a.agent:<20} {a.waiting:>8} {a.in_flight:>9} {a.redelivered:>11} {a.dead_lettered:>6} {stranded:>8}"
            f" {a.workers:>7} {a.rollouts_per_s:>10.1f}"
            + ("" if a.has_consumer else "  (no consumer yet)")
        )
    if not status.agents:
        lines.append("(no agents yet)")
    lines.append("")
    lines.append("trajectories stored per run:")
    for run, count in sorted(status.trajectories.items()):
        version = status.policy.get(run, {}).get("version")
        suffix = f"  (policy v{version})" if version is not None else ""
        lines.append(f"  {run:<30} {count:>8}{suffix}")
    if not status.trajectories:
        lines.append("  (none)")
    for run, row in sorted(status.trainer.items()):
        lines.append("")
        lines.append(
            f"trainer {run}: step {row.get('step', '?')}, version {row.get('version', '?')}, "
            f"reward {_cell(row.get('reward_mean_received'), 0).strip()}, stale dropped "
            f"{row.get('dropped_stale', 0)}"
        )
        tasks = _tasks_of(row)
        if tasks:
            lines.append(
                f"  {'task':<18} {'reward':>8} {'success':>8} {'length':>8} "
                f"{'stale drops':>11} {'dropped groups':>14}"
            )
            for agent, cells in sorted(tasks.items()):
                lines.append(
                    f"  {agent:<18} {_cell(cells.get('reward_mean_received'), 8)} "
                    f"{_cell(cells.get('success'), 8)} {_cell(cells.get('length'), 8)} "
                    f"{_cell(cells.get('dropped_stale'), 11)} {_cell(cells.get('dropped_groups'), 14)}"
                )
    lines.append("")
    lines.append(f"live workers: {len(status.workers)}")
    for w in status.workers:
        lines.append(
            f"  {w.get('worker_id', '?'):<32} agent={w.get('agent', '?')} in_flight={w.get('in_flight', 0)} "
            f"done={w.get('completed', 0)} errors={w.get('errors', 0)} dead={w.get('dead_lettered', 0)}"
            + _fleet_cell(w)
        )
    if status.environments:
        lines.append("")
        lines.append("environments:")
        rows = [EnvServiceStatus(**e) for e in status.environments]
        lines.extend("  " + line for line in format_env_status(rows, workers=False).splitlines())
    lines.extend(f"note: {n}" for n in status.notes)
    return "\n".join(lines)
