"""The seed's training example learns on the real model, and does not without a learning rate.

Runs ``agentarium demo --model smol --recipe calc`` itself (the LangChain calculator agent of
examples/calculator_agent.py through the consumer's tool fallback, SmolLM2-135M-Instruct,
rank-16 LoRA at the recipe's lr 3e-4) shrunk to fit the suite: 4 steps of 2 groups of 8, and
the demo's held-out evals (40 problems, k = 2) before and after. The control runs 1 step at lr 0
with the same flags but evals at k = 1; its trained weights are the base's, so both its evals
read the base weights. What a user relies on: held-out exact answers rise over the base
weights', the trained agent calls its tool more often than the base one, and every
multi-turn rollout trains as one row. Part of the real-model tier (``-m real_model``).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentarium.trainer.metrics import read_metrics

pytestmark = pytest.mark.real_model

SHRUNK = (
    "--model", "smol", "--recipe", "calc", "--groups-per-step", "2", "--eval-k", "2",
    "--seed", "1", "--minutes", "30",
)  # fmt: skip
# The steps end each run, never the clock: --minutes and the timeouts only stop a run that hangs
# (in the suite's loaded first pass the test took 890-1,008 s, against 379 s alone; 569 s since
# the engine's KV cache stays in place, da850c2; 1,365 s in CI's first pass on an AVX2 machine).
EVAL_TASKS = 40


def run_calc_demo(out: Path, *flags: str) -> dict:
    """One shrunk run: each held-out eval's exact-answer and tool-call rates, and the
    trainer's metrics rows."""
    argv = [sys.executable, "-m", "agentarium", "demo", "--out", str(out), *SHRUNK, *flags]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=1500)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run: dict = {"metrics": read_metrics(out / "metrics.csv")}
    for label in ("base", "trained"):
        summary = json.loads((out / f"eval-{label}" / "summary.json").read_text())
        assert summary["tasks"] == EVAL_TASKS and summary["errors"] == 0, summary
        results = [
            json.loads(line)
            for line in (out / f"eval-{label}" / "results.jsonl").read_text().splitlines()
        ]
        assert len(results) == summary["pairs"]
        run[label] = float(summary["reward_mean"])
        run[f"{label}_tool"] = sum(r["metrics"]["called_tool"] for r in results) / len(results)
    return run


@pytest.mark.long(950)  # 890-1,008 s in three loaded first passes, 569 s at da850c2
@pytest.mark.timeout(3000)
def test_the_calculator_agent_learns_its_tool_and_not_without_a_learning_rate(smol_dir, tmp_path):
    """False-failure rate, bounded from nine runs of this shape (docs/training.md: seven with
    their controls, two from the session before; not rerun: minutes each), under a normal model
    with each spread taken at its upper 95 % confidence limit. Trained held-out rate
    0.837-0.925 (mean 0.893, sd 0.035, upper limit 0.067 with 8 degrees of freedom); the base's
    evals 0.388-0.537 (mean 0.467, 15 evals of 80 samples, sd 0.040, below the 0.056 of 80
    independent samples at 0.47, which is taken instead): the learning run's eval (80 samples)
    and the control's (k = 1, 40) pooled, 120 samples, 0.046.
    - trained >= pooled + 0.15: margin 0.893 - 0.467 - 0.15 = 0.276, sd sqrt(0.067^2 +
      0.046^2) = 0.081, z = 3.40: P(fail) = 3.4e-4 (at the measured spreads, z = 5.8).
    - the trained tool-call rate >= the pooled base's + 0.1: trained 0.938-1.000 (mean 0.961,
      sd 0.020, limit 0.043), base 0.513-0.663 (mean 0.569; pooled 0.046 as above): margin
      0.291, sd 0.063, z = 4.6: 1.8e-6.
    - the control's second eval is its first and no rollout splits: not chance (below).
    Together under 4e-4 per run. What it costs: a run that learned nothing passes the first
    check with P(z >= 0.15 / sqrt(0.056^2 + 0.046^2) = 2.07) = 1.9%. Alone on two cores the
    test took 379 s (7.6 CPU-minutes) with the control at k = 2; side by side, the two runs
    took 284 s, but both demos' trainers and engines held 21.5 GB together, too much for a
    24 GiB machine running the rest of the suite, so they run one after the other."""
    learnt = run_calc_demo(tmp_path / "lr", "--steps", "4")
    assert len(learnt["metrics"]) == 4
    # the control at k = 1: its base eval is half the cost, and the pooled baseline loses little
    frozen = run_calc_demo(tmp_path / "lr0", "--lr", "0", "--steps", "1", "--eval-k", "1")
    assert len(frozen["metrics"]) == 1
    print(
        f"held-out: lr {learnt['base']:.3f} -> {learnt['trained']:.3f}, tool "
        f"{learnt['base_tool']:.3f} -> {learnt['trained_tool']:.3f}; lr 0 {frozen['base']:.3f} "
        f"-> {frozen['trained']:.3f}, tool {frozen['base_tool']:.3f} -> {frozen['trained_tool']:.3f}"
    )
    # lr 0 leaves the served weights the base's, checksum and all, so the control's second
    # eval is its first, reused (agentarium/evaluation/served.py): two evals of the base, 80 and
    # 40 samples, pooled by their samples
    assert frozen["trained"] == frozen["base"], frozen
    pooled = (2 * learnt["base"] + frozen["base"]) / 3
    pooled_tool = (2 * learnt["base_tool"] + frozen["base_tool"]) / 3
    assert learnt["trained"] >= pooled + 0.15, (learnt, frozen)
    assert learnt["trained_tool"] >= pooled_tool + 0.1, (learnt, frozen)
    # every multi-turn rollout trained as one row: its calls chained token for token
    for row in learnt["metrics"] + frozen["metrics"]:
        assert int(row["prefix_mismatches"] or 0) == 0, row
    assert sum(int(row["multi_turn_rows"] or 0) for row in learnt["metrics"]) > 0
