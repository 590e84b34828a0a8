"""What the demo trains on each built-in model, and the eval that shows the real model learnt.

``tiny`` (random weights, byte-level tokens) learns "repeat the digit" from nothing; its
defaults are the demo's historic ones. ``smol`` (SmolLM2-135M-Instruct) already speaks: it
trains on few-shot single-digit addition with an exact-answer reward
(``examples/arithmetic.py``), where it starts at about 0.1 with spread inside the groups (a
strict reward without the two solved examples starts near 0: nothing to learn from). A model
directory given by path gets tiny's task and defaults.

With ``smol`` the demo also evaluates the policy on the 20 held-out addition pairs, k attempts
each, with ``agentarium eval``'s own runner: once on the base weights before any trajectory is
fed, once on the trained weights after the last step, when every engine serves the last
version. Both evals go through the same engine; each is keyed by the weights it served
(agentarium/evaluation/served.py), so the second never reuses the first's results.
"""

from __future__ import annotations

import io
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentarium.broker import NatsSettings, Topology
from agentarium.inference import WeightFetcher, wait_served

from ..evaluation import EvalConfig, EvalRun
from .interrupt import STOP


@dataclass(frozen=True, kw_only=True)
class Preset:
    """A model's demo: its agent and task stream, and the defaults of the settings left unset."""

    agent: str  # module:function
    agent_name: str
    lr: float
    entropy_coef: float
    steps: int
    groups_per_step: int
    minutes: float
    held_out_eval: bool  # evaluate base and trained on the held-out tasks
    lora_rank: int = 0  # the default of --lora-rank
    tool_fallback: bool = False  # the consumers' (and evals') --tool-fallback: tools in text
    # the trainer's --max-tokens-per-micro-batch (0: the whole step in one pass): the calc
    # recipe's 48 rows of ~500 tokens in one pass took the trainer past 19 GB and the kernel
    # killed the engine
    max_tokens_per_micro_batch: int = 0

    def tasks(self, rng: random.Random, n: int, prefix: str, digits: str) -> list[dict]:
        if self.agent_name == "add":
            from agentarium.examples.arithmetic import add_tasks

            return add_tasks(rng, n, prefix)
        if self.agent_name == "calc":
            from agentarium.examples.calculator_agent import calc_tasks

            return calc_tasks(rng, n, prefix)
        from .tasks import digit_tasks

        return digit_tasks(rng, n, prefix, digits)

    def eval_tasks(self) -> list[dict]:
        """The held-out tasks of ``held_out_eval``."""
        if self.agent_name == "calc":
            from agentarium.examples.calculator_agent import eval_tasks as calc_eval

            return calc_eval()
        from agentarium.examples.arithmetic import eval_tasks

        return eval_tasks()


PRESETS = {
    "tiny": Preset(
        agent="agentarium.examples.toy:rollout",
        agent_name="toy",
        lr=1e-3,
        entropy_coef=0.02,
        steps=300,
        groups_per_step=16,
        minutes=10.0,
        held_out_eval=False,
    ),
    "smol": Preset(
        agent="agentarium.examples.arithmetic:rollout",
        agent_name="add",
        lr=1e-5,
        entropy_coef=0.0,
        steps=20,
        groups_per_step=8,
        minutes=20.0,
        held_out_eval=True,
    ),
    # --recipe calc: the LangChain calculator agent (examples/calculator_agent.py), rank-16
    # LoRA, 2 groups of 8 a step: a step's rows are ~500 tokens, 8x the addition's, and one
    # step of 16 took 63-82 s of single-threaded update (docs/benchmarks.md)
    "smol-calc": Preset(
        agent="agentarium.examples.calculator_agent:rollout",
        agent_name="calc",
        lr=3e-4,
        entropy_coef=0.0,
        steps=12,
        groups_per_step=2,
        minutes=14.0,
        held_out_eval=True,
        lora_rank=16,
        tool_fallback=True,
        max_tokens_per_micro_batch=4096,
    ),
}

# what each built-in model can learn in the demo (--recipe); the first is its default
RECIPES = {"tiny": ("repeat",), "smol": ("add", "calc")}


def preset_of(model: str, recipe: str | None = None) -> Preset:
    if model == "smol" and recipe == "calc":
        return PRESETS["smol-calc"]
    return PRESETS.get(model, PRESETS["tiny"])


def write_eval_tasks(path: Path, preset: Preset) -> Path:
    path.write_text("".join(json.dumps(task) + "\n" for task in preset.eval_tasks()))
    return path


async def evaluate(
    nats_url: str,
    *,
    engine_url: str,
    model_dir: Path,
    agent: str,
    tasks: Path,
    out: Path,
    k: int,
    tool_fallback: bool = False,
    llm_engine: str = "sglang",
) -> dict:
    """One eval of what the engine serves now; returns its summary (eval.json's figures)."""
    cfg = EvalConfig.of(
        agent=agent,
        tasks_file=str(tasks),
        k=k,
        llm=(engine_url,),
        model=str(model_dir),
        out_dir=str(out),
        concurrency=32,
        tool_fallback=tool_fallback,
        llm_engine=llm_engine,
    )
    run = EvalRun(cfg, NatsSettings(url=nats_url), out=io.StringIO(), err=io.StringIO())
    await run.run()
    summary = json.loads((out / "summary.json").read_text())
    summary["served"] = run.served
    return summary


async def wait_final_version(nats_url: str, run: str, timeout_s: float = 300.0) -> int | None:
    """The run's last published version once every engine serves it (None: none published)."""
    nc = await NatsSettings(url=nats_url).connect(name="agentarium-demo")
    try:
        js, topology = nc.jetstream(), Topology()
        update = await WeightFetcher(js, topology).latest(run)
        if update is None:
            return None
        served = await wait_served(js, topology, run, update.version, timeout=timeout_s)
        return update.version if served else None
    finally:
        await nc.close()


def eval_line(label: str, summary: dict) -> str:
    mean = summary.get("reward_mean")
    shown = "n/a" if mean is None else f"{mean:.3f}"
    k = summary.get("k")
    return (
        f"eval {label}: exact answers {shown} over {summary.get('tasks')} held-out tasks x "
        f"{k} (pass@{k} {summary.get(f'pass@{k}') or 0:.2f}, errors {summary.get('errors')})"
    )


class HeldOutEval:
    """The demo's two evals (``run("base")`` before feeding, ``run("trained", after_run=run)``
    after the last step) and their report. Its agent is the demo's under another name
    (``<agent>-eval``), so the demo's consumers never take its jobs, nor it theirs."""

    def __init__(
        self, args: Any, nats_url: str, model_dir: Path, out: Path, *, engine_kind: str = "sglang"
    ) -> None:
        self.args = args
        self.engine_kind = engine_kind
        self.nats_url = nats_url
        self.model_dir = model_dir
        self.out = out
        self.agent = f"{args.agent_name}-eval"
        self.tasks = write_eval_tasks(out / "eval_tasks.jsonl", args.preset)
        self.summaries: dict[str, dict] = {}

    def run(self, label: str, engine_url: str, *, after_run: str | None = None) -> dict:
        started = time.monotonic()
        if after_run is not None:
            version = STOP.run(lambda: wait_final_version(self.nats_url, after_run))
            print(f"engine serves the last version: v{version}")
        summary = STOP.run(
            lambda: evaluate(
                self.nats_url,
                engine_url=engine_url,
                model_dir=self.model_dir,
                agent=f"{self.agent}={self.args.agent}",
                tasks=self.tasks,
                out=self.out / f"eval-{label}",
                k=self.args.eval_k,
                tool_fallback=self.args.preset.tool_fallback,
                llm_engine=self.engine_kind,
            )
        )
        summary["seconds"] = round(time.monotonic() - started, 1)
        self.summaries[label] = summary
        print(f"{eval_line(label, summary)} in {summary['seconds']:.0f}s", flush=True)
        return summary

    def report(self) -> None:
        for label, summary in self.summaries.items():
            print(eval_line(label, summary))
        base, trained = self.summaries.get("base"), self.summaries.get("trained")
        if base and trained and None not in (base["reward_mean"], trained["reward_mean"]):
            gain = trained["reward_mean"] - base["reward_mean"]
            print(
                f"held-out exact answers: base {base['reward_mean']:.3f} -> trained "
                f"{trained['reward_mean']:.3f} (gain {gain:+.3f}); evals in {self.out}"
            )
