"""``agentarium demo``: the whole RL loop on one CPU machine (agentarium.demo)."""

from __future__ import annotations

import argparse
import dataclasses
import sys

from trainer import TASK_ADV_NORMS

from ..demo import DEFAULT_TASKS, FAMILIES, DemoConfig, run_demo

DESCRIPTION = """\
The whole RL loop on one CPU machine, on embedded defaults: a local nats-server (JetStream
store under --out), the local CPU engine serving the built-in tiny model, rollout consumers
running the toy agent, the GRPO trainer and the weight syncer, as child processes.

The toy task is "repeat the digit": the prompt names a digit and the reward is 1 when the
reply is that digit. The right answer depends on the prompt, so the best constant policy
scores 0.1; the model starts random (about 1/263 per token) and learns from GRPO alone.
Tasks are fed continuously, a little ahead of the trainer, so rollouts never stop. The demo
ends by writing metrics.csv and reward.png under --out.

--task-set repeat,next trains one policy on several tasks at once, each its own agent name with
its own consumer(s), fed in equal proportion, one trainer on all of them (--agent repeat
--agent next: this needs a trainer that trains several agents, one with --task-mix). Tasks:
{tasks}

--rollouts-only runs just the rollout half: publish a task file, wait for every trajectory."""


def cmd_demo(args: argparse.Namespace) -> int:
    names = {f.name for f in dataclasses.fields(DemoConfig)}
    try:
        config = DemoConfig(**{k: v for k, v in vars(args).items() if k in names and v is not None})
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return run_demo(config)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="the whole RL loop locally on the CPU: broker, engine, consumers, trainer, syncer",
        description=DESCRIPTION.format(
            tasks="\n".join(f"  {f.name:<8} {f.about}" for f in FAMILIES.values())
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--out",
        default="./agentarium-demo",
        help="output directory: broker store, logs, metrics.csv, reward.png (default %(default)s)",
    )
    p.add_argument("--steps", type=int, default=300, help="training steps (default %(default)s)")
    p.add_argument(
        "--minutes",
        type=float,
        default=10.0,
        help="stop after this long at most (default %(default)s)",
    )
    p.add_argument(
        "--groups-per-step", type=int, default=16, help="GRPO groups per step (default %(default)s)"
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=8,
        help="samples per task, one GRPO group (default %(default)s)",
    )
    p.add_argument(
        "--lr",
        type=float,
        default=1e-3,
        help="learning rate of the tiny model (default %(default)s)",
    )
    p.add_argument(
        "--entropy-coef",
        type=float,
        default=0.02,
        help="entropy bonus keeping the random tiny policy exploring until it learns (default %(default)s)",
    )
    p.add_argument(
        "--max-staleness",
        type=int,
        default=4,
        help="drop trajectories more than this many versions old (default %(default)s)",
    )
    p.add_argument(
        "--ahead",
        type=int,
        default=2,
        help="steps' worth of tasks kept queued ahead of the trainer (default %(default)s)",
    )
    p.add_argument(
        "--consumers", type=int, default=1, help="consumer processes (default %(default)s)"
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=64,
        help="rollouts at once per consumer (default %(default)s)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="seed for tasks and the trainer (default %(default)s)"
    )
    p.add_argument(
        "--digits",
        default="0123456789",
        help="digits the answers draw from (repeat's prompt names its answer); one digit makes a "
        "micro-task that needs no conditioning (default %(default)s)",
    )
    p.add_argument("--run", default=None, help="run id (default: demo-<unix time>)")
    p.add_argument(
        "--agent", default="examples.toy:rollout", help="agent function (default %(default)s)"
    )
    p.add_argument(
        "--agent-name", default="toy", help="agent name on the wire (default %(default)s)"
    )
    p.add_argument(
        "--task-set",
        metavar="TASK,TASK",
        help=f"train one policy on these tasks at once, each its own agent (of: {', '.join(FAMILIES)}); "
        "default: the single-task demo on --agent",
    )
    p.add_argument(
        "--task-adv-norm",
        choices=TASK_ADV_NORMS,
        help="passed to the trainer: per-task advantage normalisation over tokens or trajectories "
        "(default: the trainer's)",
    )
    p.add_argument(
        "--sync-rollouts",
        action="store_true",
        help="synchronous training: one step's tasks at a time, the next released only once the "
        "engine serves the weights trained on the last (the trainer's --sync-rollouts; --ahead "
        "and --max-staleness do not apply)",
    )
    p.add_argument(
        "--rollouts-only",
        action="store_true",
        help="no training: publish --tasks once and wait for every trajectory",
    )
    p.add_argument(
        "--tasks",
        default=str(DEFAULT_TASKS),
        help="task file for --rollouts-only: JSON lines, or a .parquet file in verl's format "
        "(default: the toy tasks)",
    )
    p.set_defaults(func=cmd_demo)
