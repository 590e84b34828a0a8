"""What every command shares: the parser class, the NATS connection flags, and running an
async body with logging and tracing set up (what the long-running ones share more: service.py).

Every command is a module ``<name>_cmd.py`` in this package with ``register(subparsers)``;
``agentarium.cli`` finds them, so adding a command touches no other file. A command sets
``func`` (its body) and may set ``check`` (flag combinations the parser cannot check, raising
ValueError) as parser defaults; the CLI runs ``check`` first, and the deploy-file tests run it on
every documented command line.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from agentarium.broker import NatsSettings, run_loop, setup_logging, setup_tracing, shutdown_tracing
from agentarium.schemas import settings

from ..config import add_settings

NATS_PREFIX = "nats_"  # the connection flags' dests: nats_url, nats_prefix, ...


def port_number(text: str) -> int:
    """An argparse type: a TCP port, 0-65535 (argparse names the flag in its error)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a port (0-65535)")
    return port


port_number.number_type = int  # type: ignore[attr-defined]  # for the bad-input table


def positive_float(text: str) -> float:
    """An argparse type: a number > 0 (argparse names the flag in its error)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


positive_float.number_type = float  # type: ignore[attr-defined]  # for the bad-input table


class Parser(argparse.ArgumentParser):
    """No abbreviated long options: ``--group 4`` must not silently mean ``--group-size``.
    Sub-parsers are made of the same class, so the rule holds for every command."""

    overrides_dest: str | None = None  # set by agentarium.config.add_config_arguments

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Any = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        """argparse fills a ``*`` positional from one run of positionals only, so in
        ``lr=1 --run r max_staleness=2`` the second override would be "unrecognized": KEY=VALUE
        tokens left over are overrides too, wherever they stand."""
        parsed, extras = super().parse_known_args(args, namespace)
        if self.overrides_dest and extras:
            loose = [e for e in extras if "=" in e and not e.startswith("-")]
            given = getattr(parsed, self.overrides_dest)
            # the value of an unknown flag (`--group 4`) is no override: refused with its flag
            stray = [g for g in given if "=" not in g]
            setattr(parsed, self.overrides_dest, [g for g in given if "=" in g] + loose)
            extras = [e for e in extras if e not in loose] + stray
        return parsed, extras


def add_command_group(
    parser: argparse.ArgumentParser, dest: str, metavar: str
) -> argparse._SubParsersAction:
    """Sub-commands of ``parser`` (``broker up|init|status``). Run without one, the group lists
    its commands with their help, instead of argparse's "the following arguments are required"."""
    sub = parser.add_subparsers(dest=dest, metavar=metavar)

    def list_commands(args: argparse.Namespace) -> int:
        choices = sub._choices_actions  # one per command, with its name and help
        width = max((len(a.dest) for a in choices), default=0)
        print(f"{parser.format_usage()}\n{parser.prog}: name a command:", file=sys.stderr)
        for action in choices:
            print(f"  {action.dest:<{width}}  {action.help or ''}", file=sys.stderr)
        print(f"\n`{parser.prog} COMMAND --help` shows a command's flags.", file=sys.stderr)
        return 2

    list_commands.lists_commands = True  # type: ignore[attr-defined]
    parser.set_defaults(func=list_commands)
    return sub


def add_nats_flags(parser: argparse.ArgumentParser) -> None:
    """``--nats-url`` and the rest: ``NatsSettings``' fields (broker/settings.py)."""
    group = parser.add_argument_group(
        "NATS connection",
        "Each flag overrides its environment variable; by default the server at nats://127.0.0.1:4222.",
    )
    add_settings(group, NatsSettings, prefix=NATS_PREFIX)


def settings_from_args(args: argparse.Namespace) -> NatsSettings:
    flags = settings.keys(NatsSettings, NATS_PREFIX)
    return NatsSettings.from_env(
        **{key.path[-1]: getattr(args, key.name, None) for key in flags if key.flag}
    )


def run_async(body: Callable[[], Coroutine[Any, Any, int]], *, service: str) -> int:
    """Run a command body with logging and tracing set up; Ctrl-C exits 130 quietly."""
    setup_logging()
    setup_tracing(service)
    try:
        return run_loop(body())
    except KeyboardInterrupt:
        return 130
    finally:
        shutdown_tracing()


def connection_flags(reason: str | None = None) -> dict[str, str]:
    """The NATS connection flags as key-less flags, for ``ConfigKeys.keyless``."""
    reason = reason or (
        "the connection comes from AGENTARIUM_NATS_* or these flags, so a config file never "
        "holds a credential and the same file runs against any broker"
    )
    parser = argparse.ArgumentParser(add_help=False)
    add_nats_flags(parser)
    return {action.dest: reason for action in parser._actions}
