"""``agentarium produce`` and ``agentarium trajectories show``: bodies live in producers.cli."""

from __future__ import annotations

import argparse

from producers import cli as producers_cli

from .common import add_nats_flags, run_async, settings_from_args


def cmd_produce(args: argparse.Namespace) -> int:
    return run_async(
        lambda: producers_cli.run_produce(args, settings_from_args(args)),
        service="agentarium-producer",
    )


def cmd_show(args: argparse.Namespace) -> int:
    return run_async(
        lambda: producers_cli.run_show(args, settings_from_args(args)), service="agentarium-reader"
    )


def register(sub: argparse._SubParsersAction) -> None:
    produce = sub.add_parser(
        "produce",
        help="publish tasks from a JSONL file as rollout jobs",
        description="Publish tasks (one JSON object per line) as rollout jobs, expanded into G jobs per task "
        "that share a group_id. Job ids are derived from (run, batch, task, sample), so publishing the same "
        "file twice adds nothing. Prints the run id and batch id.",
    )
    producers_cli.add_produce_arguments(produce)
    add_nats_flags(produce)
    produce.set_defaults(func=cmd_produce)

    traj = sub.add_parser(
        "trajectories",
        help="read stored trajectories back",
        description="Read stored trajectories back.",
    )
    tsub = traj.add_subparsers(dest="trajectories_command", required=True, metavar="{show}")
    show = tsub.add_parser(
        "show",
        help="print a run's trajectories as a table or JSON lines",
        description="Print a run's trajectories as a readable table, or as JSON lines (token arrays as lists) "
        "for other tools.",
    )
    producers_cli.add_show_arguments(show)
    add_nats_flags(show)
    show.set_defaults(func=cmd_show)
