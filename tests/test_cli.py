"""The `agentarium` command line itself: what a first-time user sees before any work is done."""

from __future__ import annotations

import argparse
import contextlib
import io
import re

import pytest

from agentarium.broker import free_port
from agentarium.cli import build_parser, main


def all_parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ("agentarium",)):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from all_parsers(sub, (*path, name))


def run_cli(*argv: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code
    return code, err.getvalue()


@pytest.mark.parametrize(
    "group, commands",
    [
        ((), ("broker", "consumer", "produce", "trajectories", "eval", "demo")),
        (("broker",), ("up", "init", "status", "sweep")),
        (("eval",), ("run", "summary")),
        (("trajectories",), ("show", "export")),
    ],
    ids=["agentarium", "broker", "eval", "trajectories"],
)
def test_a_command_group_without_a_command_lists_its_commands(group, commands):
    code, err = run_cli(*group)
    assert code == 2
    assert "required" not in err and "_command" not in err, err
    prog = " ".join(("agentarium", *group))
    assert f"{prog}: name a command:" in err and f"`{prog} COMMAND --help`" in err
    listed = {m.group(1) for m in re.finditer(r"^  (\S+)  +\S", err, re.M)}
    assert set(commands) <= listed, err


def test_broker_up_takes_no_connection_flags_but_a_prefix():
    parser = build_parser()
    up = dict(all_parsers(parser))[("agentarium", "broker", "up")]
    assert "--nats-url" not in up.format_help() and "--prefix" in up.format_help()
    with contextlib.redirect_stderr(io.StringIO()), pytest.raises(SystemExit):
        parser.parse_args(["broker", "up", "--nats-url", "nats://127.0.0.1:4222"])
    assert parser.parse_args(["broker", "up", "--prefix", "x"]).nats_prefix == "x"
    # init and status connect to a server: they keep them
    assert "--nats-url" in dict(all_parsers(parser))[("agentarium", "broker", "init")].format_help()


def test_help_texts_are_plain_text():
    """Descriptions are read in a terminal: no reST markup (``code``, :class:) in any --help."""
    for path, parser in all_parsers(build_parser()):
        text = parser.format_help()
        assert not re.search(r"``|:(class|func|meth|mod):`", text), (" ".join(path), text)


def test_abbreviated_flags_are_refused():
    """`--group 4` must not silently mean `--group-size 4`."""
    parser = build_parser()
    argv = ["produce", "--agent", "toy", "--file", "tasks.jsonl", "--run", "r"]
    assert parser.parse_args([*argv, "--group-size", "4"]).group_size == 4
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        parser.parse_args([*argv, "--group", "4"])
    assert exc.value.code == 2 and "unrecognized arguments: --group 4" in err.getvalue()


def test_parquet_export_without_out_is_refused_before_connecting():
    no_broker = f"nats://127.0.0.1:{free_port()}"
    code, err = run_cli(
        "trajectories", "export", "--run", "run1", "--format", "parquet", "--nats-url", no_broker
    )
    assert code == 2 and "--format parquet writes a file: pass --out PATH" in err, err
    assert "cannot connect" not in err
