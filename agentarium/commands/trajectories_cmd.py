"""``agentarium trajectories show|export``: read a run's stored trajectories back."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from pathlib import Path

from agentarium.broker import NatsSettings, Topology
from agentarium.producers import ProducerError, TrajectoryReader
from agentarium.schemas import STATUSES, Trajectory, versions_label

from ..evaluation import FORMATS, export_run
from .common import add_command_group, add_nats_flags, run_async, settings_from_args


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
        help="JSON lines in the schemas' JSON form (token arrays as lists, errors with their "
        "tracebacks) instead of a table",
    )
    parser.add_argument(
        "--follow",
        action="store_true",
        help="keep printing new trajectories as they are stored, until Ctrl-C",
    )
    parser.add_argument("--status", choices=STATUSES, help="only trajectories with this status")


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


def error_reason(error: str | None) -> str:
    """A stored error's reason, in full, on one line. For a traceback that is the exception
    (every line after the last frame, so a multi-line message stays whole); otherwise the
    whole text. ``--json`` keeps the traceback itself."""
    lines = (error or "").strip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith('  File "')]
    if frames:
        start = frames[-1] + 1
        while start < len(lines) and lines[start].startswith("    "):  # source line, ^^^ marks
            start += 1
        lines = lines[start:] or lines[-1:]
    return " ".join(line.strip() for line in lines if line.strip())


def table_row(t: Trajectory) -> str:
    # every token's weights: default, A@3, A@2..A@3 (the checksums left out)
    version = versions_label(v for c in t.calls for v, _, _ in c.version_spans()) or "-"
    cells = (
        t.job_id,
        t.group_id[:12],
        f"{t.sample_index}/{t.group_size}",
        t.status,
        "-" if t.reward is None else f"{t.reward:.4g}",
        str(len(t.calls)),
        str(sum(len(c.response_ids) for c in t.calls)),
        version,
        error_reason(t.error),  # last column: a long reason wraps without shifting the others
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
        if not shown and not args.follow and (missing := await _no_such_run(nc, topology, args)):
            print(f"error: {missing}", file=sys.stderr)
            return 1
        if not args.json:
            print(f"{shown} trajectories", file=sys.stderr)
        if reader.skipped:
            print(f"warning: {reader.skipped} undecodable messages skipped", file=sys.stderr)
        return 0
    finally:
        with contextlib.suppress(Exception):
            await nc.close()


async def _no_such_run(nc, topology: Topology, args: argparse.Namespace) -> str | None:
    """Why nothing was found, when it is that the run (or its agent) has no trajectory at all
    here: a mistyped --run must not look like an empty result."""
    from agentarium.broker import count_messages

    stored = await count_messages(
        nc.jetstream(),
        topology.trajectories_stream,
        topology.trajectories_filter(args.run, args.agent),
    )
    if stored:
        return None  # the run exists: the filters (--status, --min-reward) matched nothing
    agent = "" if args.agent == "*" else f", agent {args.agent!r}"
    return (
        f"no trajectories of run {args.run!r}{agent} on this broker: check --run (and --agent, "
        "--prefix, --nats-url)"
    )


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


def cmd_show(args: argparse.Namespace) -> int:
    return run_async(lambda: run_show(args, settings_from_args(args)), service="agentarium-reader")


def check_export(args: argparse.Namespace) -> None:
    """What the parser cannot check, before connecting: no broker is needed to say so."""
    if args.format == "parquet" and not args.out:
        raise ValueError("--format parquet writes a file: pass --out PATH (e.g. --out run.parquet)")
    if args.format == "parquet":
        import importlib.util

        from ..evaluation.export import PARQUET_NEEDS

        if importlib.util.find_spec("pyarrow") is None:
            raise ValueError(PARQUET_NEEDS)


def cmd_export(args: argparse.Namespace) -> int:
    check_export(args)
    settings = settings_from_args(args)

    async def body() -> int:
        nc = await settings.connect(name="agentarium-export")
        try:
            n = await export_run(
                nc.jetstream(),
                Topology(settings.prefix),
                run=args.run,
                agent=args.agent,
                fmt=args.format,
                out=Path(args.out) if args.out else None,
                status=None if args.status == "all" else args.status,
                multi_turn=args.multi_turn,
                min_reward=args.min_reward,
            )
            if not n and (missing := await _no_such_run(nc, Topology(settings.prefix), args)):
                print(f"error: {missing}", file=sys.stderr)
                return 1
        finally:
            await nc.close()
        print(
            f"exported {n} records of run {args.run}" + (f" to {args.out}" if args.out else ""),
            file=sys.stderr,
        )
        return 0

    return run_async(body, service="agentarium-export")


def register(sub: argparse._SubParsersAction) -> None:
    traj = sub.add_parser(
        "trajectories",
        help="read stored trajectories back: show them, or export them as a dataset",
        description="Read a run's stored trajectories back.",
    )
    tsub = add_command_group(traj, "trajectories_command", "{show,export}")
    show = tsub.add_parser(
        "show",
        help="print a run's trajectories as a table or JSON lines",
        description="Print a run's trajectories as a readable table, or as JSON lines (token arrays as lists) "
        "for other tools.",
    )
    add_show_arguments(show)
    add_nats_flags(show)
    show.set_defaults(func=cmd_show)

    export = tsub.add_parser(
        "export",
        help="write a run's trajectories as an SFT dataset (JSONL or Parquet)",
        description="Chat messages plus token arrays (input_ids, loss_mask, logprobs) per trajectory.",
    )
    export.add_argument("--run", required=True, metavar="RUN")
    export.add_argument(
        "--agent", default="*", metavar="NAME", help="only this agent (default all)"
    )
    export.add_argument("--format", choices=FORMATS, default="jsonl")
    export.add_argument(
        "--out",
        metavar="PATH",
        help="output file; required for parquet (default stdout for jsonl)",
    )
    export.add_argument(
        "--status",
        choices=("ok", "error", "timeout", "all"),
        default="ok",
        help="which trajectories (default ok)",
    )
    export.add_argument(
        "--multi-turn",
        choices=("concat", "per-call"),
        default="concat",
        help="one record per rollout (concat) or per LLM call",
    )
    export.add_argument(
        "--min-reward", type=float, metavar="R", help="keep rewards >= R (rejection sampling)"
    )
    add_nats_flags(export)
    export.set_defaults(func=cmd_export, check=check_export)
