"""``agentarium eval run|summary``: evaluate an agent, every task K times, resumable.

``eval run``'s settings are ``EvalConfig``'s fields (agentarium/evaluation/config.py), each
one a flag, a key of a --config file and a KEY=VALUE override.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from agentarium.consumers import AgentLoadError

from ..config import ConfigKeys, add_config_arguments, add_settings, resolve
from ..evaluation import EvalConfig, EvalError, EvalRun, print_summary
from .common import (
    add_command_group,
    add_nats_flags,
    connection_flags,
    run_async,
    settings_from_args,
)

KEYS = ConfigKeys.of(
    "eval run",
    EvalConfig,
    keyless={
        **connection_flags(),
        "resume": "what this invocation does with an unfinished eval, not one of its settings",
        "api_key": "a credential: from this flag or OPENAI_API_KEY, never from a file that "
        "is shared or checked in",
    },
)


def config_from_args(args: argparse.Namespace) -> EvalConfig:
    """The settings from defaults, --config, flags and overrides."""
    resolved = resolve(args, KEYS)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    return resolved.build(EvalConfig, resume=args.resume, api_key=api_key)  # type: ignore[no-any-return]


def cmd_eval_run(args: argparse.Namespace) -> int:
    try:
        cfg = config_from_args(args)
        runner = EvalRun(cfg, settings_from_args(args))
        return run_async(runner.run, service="agentarium-eval")
    except (ValueError, AgentLoadError) as exc:  # EvalError, a setting out of bounds, a file
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_eval_summary(args: argparse.Namespace) -> int:
    try:
        return print_summary(Path(args.dir))
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def register(sub: argparse._SubParsersAction) -> None:
    ev = sub.add_parser(
        "eval",
        help="evaluate an agent: every task K times, resumable",
        description="Run every task of a JSONL or parquet file K times through the rollout "
        "consumers, write results.jsonl and print mean ± std, best-of-K and pass@k.",
    )
    esub = add_command_group(ev, "eval_command", "{run,summary}")
    run = esub.add_parser(
        "run",
        help="run (or resume) an evaluation",
        description="Run every task K times. Rerunning a finished eval does "
        "nothing; --resume continues one that was interrupted. Settings may come from "
        "--config FILE.yaml and KEY=VALUE overrides (defaults < file < flags < overrides).",
    )
    add_settings(run, EvalConfig)
    run.add_argument(
        "--resume",
        action="store_true",
        help="continue an unfinished eval in --out: run only the (task, attempt) pairs "
        "without an ok trajectory",
    )
    run.add_argument(
        "--api-key", metavar="KEY", help="for --openai-base (default: env OPENAI_API_KEY)"
    )
    add_config_arguments(run, KEYS)
    add_nats_flags(run)
    run.set_defaults(func=cmd_eval_run)
    summary = esub.add_parser("summary", help="print the summary table of an eval directory")
    summary.add_argument("dir", metavar="DIR", help="the --out directory of `eval run`")
    summary.set_defaults(func=cmd_eval_summary)
