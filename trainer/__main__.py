"""``python -m trainer``: the trainer without the rest of the ``agentarium`` command.

Takes the same flags as ``agentarium trainer`` (``--model`` must be a model directory) plus
``--nats-url``; every other connection setting comes from the AGENTARIUM_NATS_* variables.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from broker import NatsSettings
from broker.telemetry import setup_logging, setup_tracing, shutdown_tracing

from .cli import add_trainer_arguments, run_trainer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m trainer", description="Asynchronous GRPO trainer on NATS JetStream."
    )
    add_trainer_arguments(parser)
    parser.add_argument("--nats-url", metavar="URL", help="NATS server (env AGENTARIUM_NATS_URL)")
    args = parser.parse_args(argv)
    setup_logging()
    setup_tracing(f"agentarium-trainer-{args.run}")
    try:
        return asyncio.run(run_trainer(args, NatsSettings.from_env(url=args.nats_url)))
    finally:
        shutdown_tracing()


if __name__ == "__main__":
    sys.exit(main())
