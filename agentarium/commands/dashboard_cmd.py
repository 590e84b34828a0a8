"""``agentarium dashboard``: the live dashboard, a web page read from the broker alone."""

from __future__ import annotations

import argparse

from agentarium.dashboard import DEFAULT_PORT, DashboardConfig, run_dashboard

from .common import add_metrics_flags, add_nats_flags, metrics_server, run_async, settings_from_args


def config_from_args(args: argparse.Namespace) -> DashboardConfig:
    return DashboardConfig(
        host=args.host,
        port=args.port,
        refresh_s=args.refresh,
        trace_url=args.trace_url or "",
        runs=tuple(args.run),
        dead_letters=args.dead_letters,
        trajectories=args.trajectories,
        sample=max(200, args.trajectories),
    )


def check(args: argparse.Namespace) -> None:
    config_from_args(args)  # raises ValueError with what to fix


def cmd_dashboard(args: argparse.Namespace) -> int:
    config = config_from_args(args)
    return run_async(
        lambda: run_dashboard(config, settings_from_args(args), metrics=metrics_server(args)),
        service="agentarium-dashboard",
    )


def register(sub: argparse._SubParsersAction) -> None:
    parser = sub.add_parser(
        "dashboard",
        help="a live web page of the run: queues, workers, rewards, trainer, engines, dead letters",
        description="Serve a live dashboard (plain HTML, no build, no CDN) that reads everything "
        "from the broker: per agent waiting / in flight / dead, live workers and rollouts/s, "
        "reward per agent over time, the trainer's steps, staleness drops, each engine's weight "
        "version, the latest trajectories (linked to their traces with --trace-url) and the "
        "latest dead letters. Open http://127.0.0.1:8266/ after starting it.",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="HTTP port (default %(default)s, next to Ray's 8265; 0 picks a free one)",
    )
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen address (default %(default)s). WARNING: the page shows previews of dead "
        "letters' tasks and errors, which may hold user data, and has no login: bind another "
        "address (0.0.0.0) only on a network you trust, or put an authenticating proxy in front",
    )
    parser.add_argument(
        "--trace-url",
        metavar="TEMPLATE",
        help="link each trajectory to its trace: a URL with {trace_id}, e.g. "
        "http://localhost:16686/trace/{trace_id} (Jaeger)",
    )
    parser.add_argument(
        "--run",
        action="append",
        default=[],
        metavar="RUN",
        help="count this run's trajectories exactly (repeatable); without it every run is "
        "counted while the store holds at most 200,000 trajectories, as in `broker status`",
    )
    parser.add_argument(
        "--refresh",
        type=float,
        default=1.0,
        metavar="SECONDS",
        help="how often the broker is read and the page updates (default %(default)s)",
    )
    parser.add_argument(
        "--dead-letters",
        type=int,
        default=20,
        metavar="N",
        help="newest dead letters shown (default %(default)s)",
    )
    parser.add_argument(
        "--trajectories",
        type=int,
        default=20,
        metavar="N",
        help="newest trajectories listed (default %(default)s)",
    )
    add_metrics_flags(parser)
    add_nats_flags(parser)
    parser.set_defaults(func=cmd_dashboard, check=check)
