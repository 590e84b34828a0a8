"""The ``agentarium`` command."""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from typing import Any

import nats.errors
import nats.js.errors

from agentarium.broker import BrokerError

from . import __version__, commands
from .commands.common import Parser, add_command_group

EPILOG = """\
Every command that talks to NATS reads AGENTARIUM_NATS_URL (default nats://127.0.0.1:4222) and the
other AGENTARIUM_NATS_* variables; flags override them. Logs are JSON lines on stderr
(AGENTARIUM_LOG_LEVEL, AGENTARIUM_LOG_FORMAT=json|console); spans go to OTLP when
OTEL_EXPORTER_OTLP_ENDPOINT is set."""


def command_modules() -> list[Any]:
    """Every ``agentarium/commands/<name>_cmd.py``, in name order; each registers itself."""
    names = sorted(
        m.name for m in pkgutil.iter_modules(commands.__path__) if m.name.endswith("_cmd")
    )
    return [importlib.import_module(f"{commands.__name__}.{name}") for name in names]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(
        prog="agentarium",
        description="The rollout layer for agentic RL on NATS JetStream: jobs in, traced trajectories out.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"agentarium {__version__}")
    sub = add_command_group(parser, "command", "COMMAND")
    for module in command_modules():
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check = getattr(args, "check", None)  # a command's checks across flags, before any work
        if check is not None:
            check(args)
        return args.func(args)
    except BrokerError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # bad input the parser could not catch (names, files)
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except nats.js.errors.NotFoundError as exc:
        print(
            f"error: {exc.description or exc}: the broker is not provisioned for Agentarium here; run "
            "`agentarium broker init` (or check AGENTARIUM_NATS_URL / --nats-url / --prefix)",
            file=sys.stderr,
        )
        return 2
    except nats.errors.Error as exc:
        print(f"error: NATS: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `agentarium trajectories show | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
