"""``agentarium eval run|summary``: evaluate an agent, every task K times, resumable."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from consumers import AgentLoadError
from schemas import SchemaError, check_name

from ..evaluation import EvalConfig, EvalError, EvalRun, print_summary
from .common import add_command_group, add_nats_flags, run_async, settings_from_args


def _agent(value: str) -> tuple[str, str | None]:
    name, sep, spec = value.partition("=")
    try:
        check_name(name, "agent")
    except SchemaError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if sep and ":" not in spec:
        raise argparse.ArgumentTypeError(f"--agent {value!r}: write NAME=module:function")
    return name, (spec or None)


def _ratio(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"--cross-ratio must be in [0, 1], got {text}")
    return value


def cmd_eval_run(args: argparse.Namespace) -> int:
    if args.llm and args.openai_base:
        print(
            "error: pass --llm (SGLang) or --openai-base (OpenAI-compatible), not both",
            file=sys.stderr,
        )
        return 2
    name, fn = args.agent
    if fn and args.env:
        print(
            f"error: --agent {name}={fn} names its own rollout function, and --env {args.env} "
            f"asks for the generic function-call agent: pass --agent {name} --env {args.env}, "
            "or drop --env",
            file=sys.stderr,
        )
        return 2
    cfg = EvalConfig(
        agent=name,
        agent_fn=fn,
        env=args.env,
        max_turns=args.max_turns,
        tasks_file=Path(args.file),
        k=args.k,
        out_dir=Path(args.out) if args.out else None,
        run=args.run,
        llm=tuple(args.llm or ()),
        openai_base=args.openai_base,
        api_key=args.api_key or os.environ.get("OPENAI_API_KEY"),
        model=args.model or "tiny",
        model_name=args.model_name,
        cross_model=args.cross_model,
        cross_model_name=args.cross_model_name,
        cross_ratio=args.cross_ratio if args.cross_model else 0.0,
        resume=args.resume,
        concurrency=args.concurrency,
        deadline_s=args.deadline,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        ack_wait_s=args.ack_wait,
        attempts=args.attempts,
        timeout_s=args.timeout,
        success_threshold=args.success_threshold,
        seed=args.seed,
        reward=args.reward,
    )
    try:
        runner = EvalRun(cfg, settings_from_args(args))
        return run_async(runner.run, service="agentarium-eval")
    except (EvalError, AgentLoadError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def cmd_eval_summary(args: argparse.Namespace) -> int:
    try:
        return print_summary(Path(args.dir))
    except EvalError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--agent",
        required=True,
        type=_agent,
        metavar="NAME[=module:function]",
        help="the agent; with =module:function (or --env) the rollouts run in this process, "
        "otherwise on running `agentarium consumer` services for NAME",
    )
    p.add_argument(
        "--env",
        metavar="ENV",
        help="the rollouts run in this process with the generic function-call agent on "
        "environment ENV (`agentarium env serve ENV`); --agent is then a bare NAME",
    )
    p.add_argument(
        "--max-turns",
        type=int,
        default=10,
        metavar="N",
        help="with --env: model calls per rollout (default 10)",
    )
    p.add_argument(
        "--file",
        required=True,
        metavar="PATH",
        help="tasks, one JSON object per line, or a .parquet file, one task per row (verl's format)",
    )
    p.add_argument("--k", type=int, default=1, metavar="K", help="attempts per task (default 1)")
    llm = p.add_argument_group("LLM (in-process consumer)")
    llm.add_argument(
        "--llm",
        action="append",
        metavar="URL",
        help="SGLang-compatible server (or `agentarium engine`); repeat for a fleet",
    )
    llm.add_argument(
        "--openai-base",
        metavar="URL",
        help="OpenAI-compatible base URL ending in /v1 (vLLM, hosted APIs): text only",
    )
    llm.add_argument(
        "--model",
        metavar="M",
        help="with --llm: the model directory whose tokenizer "
        "renders prompts (default tiny); with --openai-base: the API's model name",
    )
    llm.add_argument(
        "--model-name", metavar="NAME", help="name recorded for the model (default: from --model)"
    )
    llm.add_argument(
        "--api-key", metavar="KEY", help="for --openai-base (default: env OPENAI_API_KEY)"
    )
    llm.add_argument(
        "--cross-model",
        metavar="URL",
        help="a second model's server, of the same kind as the first: each LLM call goes "
        "there with probability --cross-ratio",
    )
    llm.add_argument(
        "--cross-model-name",
        default="cross",
        metavar="NAME",
        help="its name in the results (and its API model name with --openai-base)",
    )
    llm.add_argument(
        "--cross-ratio",
        type=_ratio,
        default=0.5,
        metavar="P",
        help="probability that a call goes to --cross-model (default 0.5)",
    )
    llm.add_argument(
        "--reward", metavar="module:fn", help="reward function fn(task, result, trajectory)"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue an unfinished eval in --out: run only the (task, attempt) pairs "
        "without an ok trajectory",
    )
    p.add_argument("--out", metavar="DIR", help="results directory (default evals/<run>)")
    p.add_argument(
        "--run", metavar="RUN", help="run id (default: derived from agent, tasks, k and models)"
    )
    p.add_argument("--concurrency", type=int, default=32, help="rollouts at once (default 32)")
    p.add_argument(
        "--deadline", type=float, default=600.0, metavar="S", help="per rollout (default 600)"
    )
    p.add_argument(
        "--max-new-tokens", type=int, metavar="N", help="tokens per LLM call (default 256)"
    )
    p.add_argument(
        "--temperature", type=float, metavar="T", help="sampling temperature (default 1.0)"
    )
    p.add_argument(
        "--ack-wait",
        type=float,
        default=60.0,
        metavar="S",
        help="redelivery timeout of in-flight jobs (default 60)",
    )
    p.add_argument("--attempts", type=int, default=3, help="runs of a failing rollout (default 3)")
    p.add_argument("--timeout", type=float, metavar="S", help="give up waiting after S seconds")
    p.add_argument(
        "--success-threshold",
        type=float,
        default=1.0,
        metavar="R",
        help="a rollout succeeds when its reward >= R, for pass@k (default 1.0)",
    )
    p.add_argument("--seed", type=int, help="seed of the cross-sampling coin")


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
        "nothing; --resume continues one that was interrupted.",
    )
    _add_run_arguments(run)
    add_nats_flags(run)
    run.set_defaults(func=cmd_eval_run)
    summary = esub.add_parser("summary", help="print the summary table of an eval directory")
    summary.add_argument("dir", metavar="DIR", help="the --out directory of `eval run`")
    summary.set_defaults(func=cmd_eval_summary)
