"""TRL's GRPO step with its rollouts run by Agentarium vs TRL's own generation: where the time goes.

The same TRL ``GRPOTrainer`` (trl 1.16, the CPU), model (the tiny one), batch (``--prompts`` x
``--generations`` samples of the ``examples.toy.any_digit`` task, 2 completion tokens), seed
and settings, twice in one process:

- **builtin**: TRL generates with the model itself (``model.generate``), and a reward function
  scores the completions text as ``any_digit`` does;
- **agentarium**: ``rollout_func`` = ``agentarium.integrations.trl.AgentariumRollout`` and the
  weight-sync callback; a nats-server, the local engine, ``agentarium consumer`` and
  ``agentarium sync`` as child processes, as ``examples/trl_trainer.py`` expects them.

Per step (wall time from one ``on_step_end`` to the next, the first ``--warmup`` steps left out)
the agentarium run is split into: the rollouts (``rollout_func``: jobs published, consumers,
engine, trajectories back), of which the wait for the engine to serve the last published
version; the weight publish (the callback: save, object store, KV); and the rest (TRL's own
log-prob forward, loss, backward, optimizer). The builtin run into TRL's generation and the
rest.

    PYTHONPATH=. .venv/bin/python bench/trl_rollouts.py --steps 12
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from agentarium.broker import NatsServer, NatsSettings  # noqa: E402
from agentarium.demo.processes import Child, start_child  # noqa: E402
from agentarium.examples.trl_trainer import grpo_config, prompts  # noqa: E402
from agentarium.integrations.config import RolloutConfig  # noqa: E402
from agentarium.integrations.trl import AgentariumRollout  # noqa: E402
from agentarium.tiny import ensure_tiny_model  # noqa: E402

AGENT, RUN = "digit", "bench-trl"


class Clock:
    """Seconds spent in named parts, per optimizer step."""

    def __init__(self) -> None:
        self.parts: dict[str, float] = defaultdict(float)
        self.steps: list[dict[str, float]] = []
        self.last = time.perf_counter()

    def add(self, part: str, seconds: float) -> None:
        self.parts[part] += seconds

    def step(self) -> None:
        now = time.perf_counter()
        self.steps.append({"wall": now - self.last, **self.parts})
        self.parts = defaultdict(float)
        self.last = now


def timed(clock: Clock, part: str, fn):
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            clock.add(part, time.perf_counter() - started)

    return wrapper


def digit_reward(completions, **kwargs) -> list[float]:
    """``examples.toy.any_digit``'s reward on TRL's own completions."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [1.0 if t.strip()[:1].isdigit() else 0.0 for t in texts]


def grpo(args, output_dir: str, mode: str, clock: Clock, model_dir: str, rollout=None):
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOTrainer

    from agentarium.integrations.trl import agent_reward

    class Steps(TrainerCallback):
        def on_step_end(self, *a, **kw):
            clock.step()

    config = grpo_config(
        output_dir,
        steps=args.steps,
        lr=args.lr,
        prompts_per_step=args.prompts,
        generations=args.generations,
        seed=args.seed,
    )
    callbacks = []
    if rollout is not None:
        sync = rollout.weight_sync(model_dir=model_dir)
        sync._publish = timed(clock, "publish", sync._publish)
        callbacks.append(sync)
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=agent_reward if rollout is not None else digit_reward,
        args=config,
        train_dataset=Dataset.from_list(prompts(args.prompts * args.steps)),
        rollout_func=rollout,
        callbacks=[*callbacks, Steps()],
    )
    if rollout is None:
        trainer._generate_single_turn = timed(clock, "generate", trainer._generate_single_turn)
    clock.last = time.perf_counter()
    trainer.train()
    return [e["reward"] for e in trainer.state.log_history if "reward" in e]


class TimedRollout(AgentariumRollout):
    clock: Clock

    def __call__(self, prompts, trainer):
        started = time.perf_counter()
        try:
            return super().__call__(prompts, trainer)
        finally:
            self.clock.add("rollouts", time.perf_counter() - started)

    def wait_served(self, version: int) -> None:
        started = time.perf_counter()
        try:
            super().wait_served(version)
        finally:
            self.clock.add("served_wait", time.perf_counter() - started)


def services(work: Path, model_dir: str) -> tuple[NatsServer, list[Child]]:
    server = NatsServer(store_dir=work / "nats").start()
    nats = ["--nats-url", server.url]
    logs = work / "logs"
    engine = start_child(
        "engine", ["engine", "--model", model_dir, "--port", "0"], logs, wait_ready=True
    )
    consumer = start_child(
        "consumer",
        ["consumer", "--agent", f"{AGENT}=agentarium.examples.toy:any_digit", "--llm", engine.url,
         "--model", model_dir, "--concurrency", "256", *nats],
        logs,
    )  # fmt: skip
    sync = start_child(
        "sync",
        ["sync", "--run", RUN, "--engine", engine.url, "--weights-dir", str(work / "w"), *nats],
        logs,
    )
    return server, [engine, consumer, sync]


def summary(name: str, steps: list[dict[str, float]], warmup: int) -> None:
    kept = steps[warmup:]
    parts = sorted({k for s in kept for k in s} - {"wall"})
    wall = statistics.median(s["wall"] for s in kept)
    line = f"{name:10s} step {wall:6.3f} s (median of {len(kept)})"
    accounted = 0.0
    for part in parts:
        value = statistics.median(s.get(part, 0.0) for s in kept)
        accounted += value if part != "served_wait" else 0.0
        line += f"  {part} {value:.3f}"
    print(f"{line}  rest {wall - accounted:.3f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per mode (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="first steps left out (default 2)")
    p.add_argument("--prompts", type=int, default=8, help="prompts per step (default 8)")
    p.add_argument("--generations", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--order",
        default="builtin,agentarium",
        help="which mode runs first (default builtin,agentarium): the machine's load drifts",
    )
    args = p.parse_args()
    model_dir = str(ensure_tiny_model())
    clocks: dict[str, Clock] = {}
    rewards: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-trl-") as tmp:
        work = Path(tmp)
        for mode in args.order.split(","):
            clock = clocks[mode] = Clock()
            if mode == "builtin":
                rewards[mode] = grpo(args, str(work / mode), mode, clock, model_dir)
                continue
            server, children = services(work, model_dir)
            try:
                rollout = TimedRollout(
                    RolloutConfig(agent=AGENT, run=RUN), settings=NatsSettings(url=server.url)
                )
                rollout.clock = clock
                with rollout:
                    rewards[mode] = grpo(args, str(work / mode), mode, clock, model_dir, rollout)
            finally:
                for child in children:
                    child.terminate()
                server.stop()
    for mode, clock in clocks.items():
        summary(mode, clock.steps, args.warmup)
    for mode, values in rewards.items():
        print(f"reward {mode:10s} {[round(r, 2) for r in values]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
