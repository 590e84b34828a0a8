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
from .commands.examples import epilog_of

EPILOG = """\
Every command that talks to NATS reads AGENTARIUM_NATS_URL (default nats://127.0.0.1:4222) and the
other AGENTARIUM_NATS_* variables; flags override them. Logs are JSON lines on stderr
(AGENTARIUM_LOG_LEVEL, AGENTARIUM_LOG_FORMAT=json|console); spans go to OTLP when
OTEL_EXPORTER_OTLP_ENDPOINT is set. A failure is one line on stderr; AGENTARIUM_DEBUG=1 shows its
traceback."""

DEBUG = "AGENTARIUM_DEBUG"


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
    for path, leaf in leaf_parsers(parser):
        leaf.epilog = epilog_of(path, leaf.epilog)
        if leaf.formatter_class is argparse.HelpFormatter:
            leaf.formatter_class = ExamplesFormatter
    return parser


def leaf_parsers(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> list[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every command that runs (``broker up``, ``trainer``, ...), with its path of names."""
    groups = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not groups:
        return [(path, parser)]
    return [
        leaf
        for group in groups
        for name, child in group.choices.items()
        for leaf in leaf_parsers(child, (*path, name))
    ]


class ExamplesFormatter(argparse.HelpFormatter):
    """argparse's formatter, except that the examples at the end keep their lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if not text.startswith("examples:"):
            return super()._fill_text(text, width, indent)
        return "".join(indent + line + "\n" for line in text.splitlines())


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
    except nats.js.errors.ServiceUnavailableError:
        print(
            "error: NATS answered without JetStream: this server runs without it (start "
            "nats-server with -js, or run `agentarium broker up`), or its JetStream is not "
            "ready; check AGENTARIUM_NATS_URL / --nats-url",
            file=sys.stderr,
        )
        return 2
    except nats.errors.Error as exc:
        print(f"error: NATS: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `agentarium trajectories show | head`: the reader left, not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # a port in use, a host that does not resolve, a missing file
        if os.environ.get(DEBUG):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a bug, or a case nothing above names: one line all the same
        if os.environ.get(DEBUG):
            raise
        print(
            f"error: {type(exc).__name__}: {exc} ({DEBUG}=1 shows the traceback)", file=sys.stderr
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
