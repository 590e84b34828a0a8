"""``agentarium produce``: publish a task file as rollout jobs.

Its settings are ``ProduceCommand``'s fields: who the jobs are for, their run and batch, and
``producers.JobOptions`` (what the jobs share, ``Sampling`` among it), each one a flag, a key of
a --config file and a KEY=VALUE override (agentarium/config/). The task file is a flag only.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import IO

import structlog

from agentarium.broker import START_PATIENCE_S, NatsSettings, Topology, ensure_streams
from agentarium.producers import (
    MAX_IN_FLIGHT,
    JobOptions,
    ProducerError,
    RoutingProblem,
    TaskFile,
    TaskProducer,
    Unrouted,
    agent_of,
    expand_tasks,
    read_task_file,
)
from agentarium.schemas import SchemaError, check_name, check_settings, section, setting, settings

from ..config import ConfigKeys, add_config_arguments, add_settings, resolve
from .common import add_nats_flags, connection_flags, run_async, settings_from_args

log = structlog.get_logger("agentarium.producers")

PROGRESS_MIN_JOBS = 2000  # below this a batch is over before a progress line helps
PROGRESS_EVERY_S = 1.0


@dataclass(frozen=True, kw_only=True)
class ProduceCommand:
    """Who the jobs are for, the run and batch they belong to and how many publishes wait at
    once; then what they share (``JobOptions``)."""

    agent: str | None = setting(
        None,
        metavar="NAME",
        help="agent the jobs are for ([A-Za-z0-9_-]); with --agent-from, the agent of the rows "
        "whose column names none",
    )
    agent_from: str | None = setting(
        None,
        metavar="COLUMN",
        help="each task's agent is its COLUMN value (data_source for verl datasets), the rule "
        "AgentOrchestrator applies: an agent_name field wins, then COLUMN when it is an agent "
        "name, then --agent",
    )
    run: str = setting("default", metavar="RUN", help="run id the trajectories are stored under")
    batch_id: str | None = setting(
        None,
        metavar="ID",
        help="batch id (default: a digest of the agent, run, group size, --eval and the tasks, "
        "so the same file twice gives the same job ids and adds nothing); pass a new one to run "
        "a file again",
    )
    max_in_flight: int = setting(MAX_IN_FLIGHT, ge=1, help="publishes awaiting their ack at once")
    jobs: JobOptions = section(JobOptions)

    def __post_init__(self) -> None:
        check_settings(self)
        if not self.agent and not self.agent_from:
            raise ValueError(
                "name the agent: pass --agent NAME, or --agent-from COLUMN to route by a column"
            )


KEYS = ConfigKeys.of(
    "produce",
    ProduceCommand,
    keyless={
        "file": "the tasks to publish, not a setting of how they are published: one settings "
        "file serves every task file",
        **connection_flags(),
    },
)


def add_produce_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``agentarium produce`` (NATS connection flags are added by the caller)."""
    parser.add_argument(
        "--file",
        required=True,
        metavar="PATH",
        help="tasks as JSON lines, one object per line (blank lines skipped; '-' reads stdin), "
        "or a .parquet file, one task per row (verl's prompt, data_source, reward_model, "
        "extra_info columns included). A task's id is its task_id or id field, else its position",
    )
    add_settings(parser, ProduceCommand)
    add_config_arguments(parser, KEYS)


def command_from_args(args: argparse.Namespace) -> ProduceCommand:
    """The settings from defaults, --config, flags and overrides; a ValueError says what to fix."""
    command: ProduceCommand = resolve(args, KEYS).build(ProduceCommand)
    return command


def check_produce(args: argparse.Namespace) -> None:
    """What the parser cannot check: the settings build (some agent is named)."""
    command_from_args(args)


def route(tasks: list[dict], agent_from: str, default: str | None, where: TaskFile) -> list[str]:
    """One agent per task by ``producers.agent_of``; every task without one is named."""
    problems: dict[RoutingProblem, list[int]] = {}
    agents = []
    for task, position in zip(tasks, where.positions, strict=True):
        agent, problem = agent_of(task, known=_is_name, default=default, source=agent_from)
        if problem is not None:
            problems.setdefault(problem, []).append(position)
        agents.append(agent or "")
    if not problems:
        return agents
    lines = []
    fix = "pass --agent NAME for such rows, or give them an agent_name field"
    for problem, positions in problems.items():
        unit = where.unit + ("s" if len(positions) > 1 else "")
        at = f"{unit} {', '.join(map(str, positions[:5]))}" + (
            f" and {len(positions) - 5} more" if len(positions) > 5 else ""
        )
        if problem.kind is Unrouted.UNKNOWN_AGENT:
            lines.append(
                f"{at}: agent_name {problem.value!r} is not an agent name ([A-Za-z0-9_-]): fix it"
            )
        elif problem.kind is Unrouted.SOURCE_NOT_AGENT:
            lines.append(
                f"{at}: {agent_from} {problem.value!r} is not an agent name ([A-Za-z0-9_-]): {fix}"
            )
        else:
            lines.append(f"{at}: no {agent_from}: {fix}")
    raise SchemaError("; ".join(lines))


def _is_name(name: str) -> bool:
    try:
        check_name(name, "agent")
    except SchemaError:
        return False
    return True


class _Progress:
    def __init__(self, total: int, out: IO[str]) -> None:
        self.total = total
        self.out = out
        self.started = self.last = time.monotonic()
        self.enabled = total >= PROGRESS_MIN_JOBS

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if self.enabled and (now - self.last >= PROGRESS_EVERY_S or done == total):
            self.last = now
            rate = done / max(now - self.started, 1e-9)
            print(f"produce: {done}/{total} jobs stored ({rate:.0f}/s)", file=self.out, flush=True)


async def run_produce(args: argparse.Namespace, nats: NatsSettings) -> int:
    command = command_from_args(args)
    source = "<stdin>" if args.file == "-" else args.file
    try:
        task_file = read_task_file(args.file)
        tasks = task_file.tasks
        if not tasks:
            raise SchemaError(f"{source} holds no tasks")
        agents: str | list[str] = (
            route(tasks, command.agent_from, command.agent, task_file)
            if command.agent_from
            else str(command.agent)
        )
        # Everything is validated before connecting: a typo costs no broker round trip.
        batch_id, jobs = expand_tasks(
            agents, tasks, run=command.run, batch_id=command.batch_id, **vars(command.jobs)
        )
    except SchemaError as exc:
        rows = getattr(exc, "rows", None)
        if rows:
            first, second = (task_file.positions[r] for r in rows)
            print(
                f"error: {source}: {task_file.unit}s {first} and {second} have the same task id: "
                f"{exc}",
                file=sys.stderr,
            )
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    per_agent = Counter(job.agent for job in jobs)
    log.info(
        "produce",
        **{**settings.flatten(command), "batch_id": batch_id},
        jobs_per_agent=dict(per_agent),
        tasks=len(tasks),
        jobs=len(jobs),
        nats=nats.redacted(),
    )
    topology = Topology(prefix=nats.prefix)
    producer = await TaskProducer.connect(
        nats, topology=topology, max_in_flight=command.max_in_flight
    )
    async with producer:
        # Create what a fresh broker lacks; never reset limits an operator set with broker init.
        # A leader election under way is waited out, as the publishes below wait it out.
        created = await ensure_streams(producer.js, topology, patience_s=START_PATIENCE_S)
        if created:
            print(f"produce: created {', '.join(created)}", file=sys.stderr)
        try:
            published, duplicates = await producer.publish_jobs(
                jobs, on_progress=_Progress(len(jobs), sys.stderr)
            )
        except ProducerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    if command.agent_from:
        shares = " ".join(f"{agent}={n}" for agent, n in sorted(per_agent.items()))
        print(f"produce: jobs per agent: {shares}", file=sys.stderr)
    print(
        f"run={command.run} batch={batch_id} jobs={len(jobs)} published={published} "
        f"duplicates={duplicates}"
    )
    return 0


def cmd_produce(args: argparse.Namespace) -> int:
    return run_async(
        lambda: run_produce(args, settings_from_args(args)), service="agentarium-producer"
    )


def register(sub: argparse._SubParsersAction) -> None:
    produce = sub.add_parser(
        "produce",
        help="publish tasks from a JSONL or parquet file as rollout jobs",
        description="Publish tasks (one JSON object per line, or one parquet row each) as rollout jobs, expanded into G jobs per task "
        "that share a group_id. Job ids are derived from (run, batch, task, sample), so publishing the same "
        "file twice adds nothing. Prints the run id and batch id. Settings may come from --config "
        "FILE.yaml and KEY=VALUE overrides (defaults < file < flags < overrides).",
    )
    add_produce_arguments(produce)
    add_nats_flags(produce)
    produce.set_defaults(func=cmd_produce, check=check_produce)
