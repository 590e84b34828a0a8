"""Bodies of ``agentarium produce`` and ``agentarium trajectories show``.

``agentarium/cli.py`` builds the parsers (adding the NATS connection flags) and calls
these; they print results on stdout and progress and errors on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import time
from collections.abc import Iterable
from typing import IO, Any

import structlog

from broker import NatsSettings, Topology
from broker.provision import ensure_streams
from schemas import STATUSES, Sampling, SchemaError, Trajectory

from .errors import ProducerError
from .jobs import expand_tasks
from .reader import TrajectoryReader
from .sdk import TaskProducer

log = structlog.get_logger("agentarium.producers")

PROGRESS_MIN_JOBS = 2000  # below this a batch is over before a progress line helps
PROGRESS_EVERY_S = 1.0


def add_produce_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--agent", required=True, metavar="NAME", help="agent the jobs are for ([A-Za-z0-9_-])"
    )
    parser.add_argument(
        "--file",
        required=True,
        metavar="PATH",
        help="tasks as JSON lines, one object per line (blank lines skipped); '-' reads stdin. "
        "A task's id is its task_id or id field, else its position",
    )
    parser.add_argument(
        "--group-size",
        type=_positive_int,
        default=1,
        metavar="G",
        help="samples per task: G jobs sharing a group_id, for GRPO (default 1)",
    )
    parser.add_argument(
        "--run",
        default="default",
        metavar="RUN",
        help="run id the trajectories are stored under (default: default)",
    )
    parser.add_argument(
        "--batch-id",
        metavar="ID",
        help="batch id (default: a digest of the agent, run, group size, --eval and the tasks, so the "
        "same file twice gives the same job ids and adds nothing); pass a new one to run a file again",
    )
    parser.add_argument(
        "--eval", action="store_true", help="evaluation jobs (is_train=false): never trained on"
    )
    parser.add_argument(
        "--temperature", type=float, metavar="T", help="sampling temperature (default 1.0)"
    )
    parser.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        metavar="N",
        help="tokens per LLM call (default 256)",
    )
    parser.add_argument(
        "--deadline",
        type=float,
        default=600.0,
        metavar="S",
        help="seconds a rollout may take (default 600)",
    )
    parser.add_argument(
        "--max-in-flight",
        type=_positive_int,
        default=512,
        metavar="N",
        help="publishes awaiting their ack at once (default 512)",
    )


def add_show_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--run", required=True, metavar="RUN", help="the run whose trajectories to show"
    )
    parser.add_argument(
        "--agent", default="*", metavar="NAME", help="only this agent's trajectories (default: all)"
    )
    parser.add_argument(
        "--json",
        action="store_true",
        help="JSON lines in the schemas' JSON form (token arrays as lists) instead of a table",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep printing new trajectories as they are stored, until Ctrl-C",
    )
    parser.add_argument("--status", choices=STATUSES, help="only trajectories with this status")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# produce


def read_tasks(lines: Iterable[str], source: str) -> tuple[list[dict[str, Any]], list[int]]:
    """Parse JSONL into task objects and their 1-based line numbers; a bad line names itself."""
    tasks, line_numbers = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            task = json.loads(line)
        except json.JSONDecodeError as exc:
            raise SchemaError(
                f"{source}:{number}: not valid JSON ({exc.msg} at column {exc.colno})"
            ) from exc
        if not isinstance(task, dict):
            raise SchemaError(
                f"{source}:{number}: a task must be a JSON object, got {type(task).__name__}"
            )
        tasks.append(task)
        line_numbers.append(number)
    return tasks, line_numbers


def _open_tasks(path: str) -> tuple[IO[str], str]:
    if path == "-":
        return sys.stdin, "<stdin>"
    try:
        return open(path, encoding="utf-8"), path  # noqa: SIM115 - closed by the caller
    except OSError as exc:
        raise SchemaError(f"cannot read tasks file {path!r}: {exc.strerror}") from exc


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


async def run_produce(args: argparse.Namespace, settings: NatsSettings) -> int:
    try:
        handle, source = _open_tasks(args.file)
        with handle if handle is not sys.stdin else contextlib.nullcontext(handle):
            tasks, line_numbers = read_tasks(handle, source)
        if not tasks:
            raise SchemaError(f"{source} holds no tasks")
        sampling = Sampling(
            **{
                k: v
                for k, v in {
                    "temperature": args.temperature,
                    "max_new_tokens": args.max_new_tokens,
                }.items()
                if v is not None
            }
        )
        # Everything is validated before connecting: a typo costs no broker round trip.
        batch_id, jobs = expand_tasks(
            args.agent,
            tasks,
            run=args.run,
            group_size=args.group_size,
            batch_id=args.batch_id,
            is_train=not args.eval,
            sampling=sampling,
            deadline_s=args.deadline,
        )
    except SchemaError as exc:
        rows = getattr(exc, "rows", None)
        if rows:
            first, second = (line_numbers[r] for r in rows)
            print(
                f"error: {source}: lines {first} and {second} have the same task id: {exc}",
                file=sys.stderr,
            )
        else:
            print(f"error: {exc}", file=sys.stderr)
        return 2
    log.info(
        "produce",
        agent=args.agent,
        run=args.run,
        batch_id=batch_id,
        tasks=len(tasks),
        jobs=len(jobs),
        group_size=args.group_size,
        is_train=not args.eval,
        max_in_flight=args.max_in_flight,
        nats=settings.redacted(),
    )
    topology = Topology(prefix=settings.prefix)
    producer = await TaskProducer.connect(
        settings, topology=topology, max_in_flight=args.max_in_flight
    )
    async with producer:
        # Create what a fresh broker lacks; never reset limits an operator set with broker init.
        created = await ensure_streams(producer.js, topology)
        if created:
            print(f"produce: created {', '.join(created)}", file=sys.stderr)
        try:
            published, duplicates = await producer.publish_jobs(
                jobs, on_progress=_Progress(len(jobs), sys.stderr)
            )
        except ProducerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
    print(
        f"run={args.run} batch={batch_id} jobs={len(jobs)} published={published} duplicates={duplicates}"
    )
    return 0


# trajectories show

_COLUMNS = (
    ("job", 32),
    ("group", 12),
    ("sample", 6),
    ("status", 7),
    ("reward", 8),
    ("calls", 5),
    ("resp_tok", 8),
    ("version", 8),
    ("error", 0),
)


def table_header() -> str:
    return " ".join(f"{name:<{width}}" if width else name for name, width in _COLUMNS)


def table_row(t: Trajectory) -> str:
    versions = sorted({c.weight_version for c in t.calls})
    version = (
        versions[0]
        if len(versions) == 1
        else (f"{versions[0]}..{versions[-1]}" if versions else "-")
    )
    error = (t.error or "").strip().splitlines()
    cells = (
        t.job_id,
        t.group_id[:12],
        f"{t.sample_index}/{t.group_size}",
        t.status,
        "-" if t.reward is None else f"{t.reward:.4g}",
        str(len(t.calls)),
        str(sum(len(c.response_ids) for c in t.calls)),
        version,
        (error[-1] if error else "")[:80],
    )
    return " ".join(
        f"{cell:<{w}}" if w else cell for cell, (_, w) in zip(cells, _COLUMNS, strict=True)
    ).rstrip()


def _emit(t: Trajectory, as_json: bool) -> None:
    line = json.dumps(t.to_wire(binary=False), separators=(",", ":")) if as_json else table_row(t)
    print(line, flush=True)


async def run_show(args: argparse.Namespace, settings: NatsSettings) -> int:
    topology = Topology(prefix=settings.prefix)
    topology.trajectories_filter(args.run, args.agent)  # bad names fail here, before connecting
    nc = await settings.connect(name="agentarium-reader")
    try:
        reader = TrajectoryReader(nc.jetstream(), topology)
        if not args.json:
            print(table_header(), flush=True)
        try:
            shown = await _show(reader, args)
        except ProducerError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"{shown} trajectories", file=sys.stderr)
        if reader.skipped:
            print(f"warning: {reader.skipped} undecodable messages skipped", file=sys.stderr)
        return 0
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _show(reader: TrajectoryReader, args: argparse.Namespace) -> int:
    shown = 0
    if args.follow:
        with contextlib.suppress(asyncio.CancelledError):  # Ctrl-C: stop following, print the count
            async for t in reader.follow(args.run, args.agent):
                if args.status is None or t.status == args.status:
                    _emit(t, args.json)
                    shown += 1
    else:
        for t in await reader.read(args.run, args.agent, status=args.status):
            _emit(t, args.json)
            shown += 1
    return shown
