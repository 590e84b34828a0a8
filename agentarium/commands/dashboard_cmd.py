"""``agentarium dashboard``: the live dashboard, a web page read from the broker alone."""

from __future__ import annotations

import argparse

from agentarium.dashboard import DashboardConfig, run_dashboard
from agentarium.schemas import settings

from ..config import add_settings, flag_values
from .common import run_async, settings_from_args
from .service import add_service_flags, metrics_server


def config_from_args(args: argparse.Namespace) -> DashboardConfig:
    values = flag_values(args, DashboardConfig)
    # the latest-trajectories list comes from the sample: read at least as many
    values["sample"] = max(DashboardConfig().sample, values["trajectories"])
    return settings.build(DashboardConfig, values)  # type: ignore[no-any-return]


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
    add_settings(parser, DashboardConfig)
    add_service_flags(parser)
    parser.set_defaults(func=cmd_dashboard, check=check)
