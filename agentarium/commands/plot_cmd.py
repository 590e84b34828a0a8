"""``agentarium plot``: a trainer's metrics CSV as a PNG (trainer.plot_metrics)."""

from __future__ import annotations

import argparse
import sys

from agentarium.trainer import plot_metrics


def add_plot_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("metrics", metavar="METRICS.csv", help="a trainer's --metrics file")
    parser.add_argument(
        "-o",
        "--output",
        default="reward.png",
        metavar="PNG",
        help="where to write the plot (default %(default)s)",
    )
    parser.add_argument(
        "--column",
        default="reward_mean_received",
        help="which column to plot against step (default %(default)s)",
    )


def cmd_plot(args: argparse.Namespace) -> int:
    try:
        path = plot_metrics(args.metrics, args.output, column=args.column)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "plot",
        help="plot a trainer's metrics CSV (reward vs step) to PNG",
        description="Plot a trainer's --metrics CSV (reward vs step by default) to a PNG file.",
    )
    add_plot_arguments(parser)
    parser.set_defaults(func=cmd_plot)
