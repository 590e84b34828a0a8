"""The bad-input table's harness (tests/test_bad_input.py): every numeric flag of every
command, at values it must refuse, checked where each command checks its settings, before any
work (no server, model or process is started)."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from agentarium.cli import build_parser, leaf_parsers

NO_BROKER = "nats://127.0.0.1:1"

# What each command needs besides the flag tried, so that only that flag can be wrong.
BASE: dict[tuple[str, ...], tuple[str, ...]] = {
    ("broker", "up"): ("--port", "0"),
    ("broker", "init"): ("--nats-url", NO_BROKER),
    ("consumer",): ("--agent", "toy=agentarium.examples.toy:rollout", "--llm", "http://127.0.0.1:1",
                    "--model", "tiny"),
    ("dashboard",): (),
    ("demo",): (),
    ("engine",): ("--model", "tiny"),
    ("env", "serve"): ("shell",),
    ("env", "bridge"): ("--agentbench", "http://127.0.0.1:1"),
    ("env", "status"): (),
    ("eval", "run"): ("--agent", "toy=agentarium.examples.toy:rollout", "--file",
                      "examples/toy_tasks.jsonl", "--llm", "http://127.0.0.1:1",
                      "--model", "tiny"),
    ("produce",): ("--file", "examples/toy_tasks.jsonl", "--agent", "toy"),
    ("sync",): ("--run", "r", "--engine", "http://127.0.0.1:1"),
    ("trainer",): ("--run", "r", "--agent", "a", "--model", "tiny"),
    ("trajectories", "export"): ("--run", "r", "--out", "x.jsonl"),
}  # fmt: skip


def _checker(path: tuple[str, ...]) -> Callable[[argparse.Namespace], Any]:
    """Each command's own check of its settings: what its command function calls first."""
    from agentarium.commands import (
        broker_cmd,
        consumer_cmd,
        dashboard_cmd,
        engine_cmd,
        env_cmd,
        eval_cmd,
        produce_cmd,
        sync_cmd,
        trainer_cmd,
    )
    from agentarium.config import flag_values, resolve
    from agentarium.demo import DemoConfig
    from agentarium.schemas import settings

    return {
        ("broker", "up"): broker_cmd._limits,
        ("broker", "init"): broker_cmd._limits,
        ("consumer",): consumer_cmd.config_from_args,
        ("dashboard",): dashboard_cmd.config_from_args,
        ("demo",): lambda args: settings.build(DemoConfig, flag_values(args, DemoConfig)),
        ("engine",): lambda args: resolve(args, engine_cmd.KEYS).build(engine_cmd.EngineCommand),
        ("env", "serve"): env_cmd.config_from_args,
        ("env", "bridge"): env_cmd.bridge_config_from_args,
        ("env", "status"): lambda args: None,  # its one number is checked by argparse
        ("eval", "run"): eval_cmd.config_from_args,
        ("produce",): lambda args: resolve(args, produce_cmd.KEYS).build(
            produce_cmd.ProduceCommand
        ),
        ("sync",): lambda args: resolve(args, sync_cmd.KEYS).build(sync_cmd.SyncCommand),
        ("trainer",): trainer_cmd.resolve_args,
        ("trajectories", "export"): lambda args: None,
    }[path]


def numeric_flags() -> list[tuple[tuple[str, ...], str, type]]:
    """(command, flag, int or float) for every flag that takes a number."""
    out = []
    for path, leaf in leaf_parsers(build_parser()):
        for action in leaf._actions:
            kind = getattr(action.type, "number_type", None) or action.type
            name = getattr(kind, "__name__", "")
            if action.option_strings and name in ("int", "float", "_port"):
                number = float if name == "float" else int
                out.append((path, action.option_strings[-1], number))
    return out


def outcome(path: tuple[str, ...], flag: str, value: str) -> tuple[bool, str]:
    """(refused, what was said): the command's parse and settings check of ``flag value``."""
    parser = build_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args([*path, *BASE[path], flag, value])
            _checker(path)(args)
    except SystemExit as exc:  # argparse's refusal: usage, then "error: ..."
        return exc.code == 2, err.getvalue().strip().splitlines()[-1]
    except ValueError as exc:  # SettingError, ConfigError, TrainerConfigError: all ValueErrors
        return True, str(exc)
    return False, ""


_CHILD = """
import contextlib, io, json, os, sys
from agentarium.cli import main
{prelude}
cases, results = json.load(open(sys.argv[1])), []
for argv in cases:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            code = main(argv)
    except SystemExit as exc:
        code = exc.code
    results.append([code, err.getvalue()])
json.dump(results, open(sys.argv[2], "w"))
"""


def run_in_child(
    cases: Sequence[Sequence[str]], workdir: Path, prelude: str = ""
) -> list[tuple[int, str]]:
    """``agentarium.cli.main(argv)`` for each case, all in one child process run in
    ``workdir`` (main sets up logging and tracing for the process: in the test's own process
    they would outlive the test); each case's exit code and what it wrote to stderr."""
    todo, done = workdir / "cases.json", workdir / "results.json"
    todo.write_text(json.dumps([list(c) for c in cases]))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    subprocess.run(
        [sys.executable, "-c", _CHILD.format(prelude=prelude), str(todo), str(done)],
        cwd=workdir, env=env, check=True, timeout=600,
    )  # fmt: skip
    return [(code, err) for code, err in json.loads(done.read_text())]
