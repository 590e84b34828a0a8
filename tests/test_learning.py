"""The RL loop learns through the real pipeline: broker, engine, consumer, trainer, syncer.

Runs ``agentarium demo`` itself on a micro-task (every prompt asks for the digit 7, so no
conditioning is needed) with fixed task and trainer seeds, and reads the trainer's
metrics: with a learning rate the reward rises; with learning rate 0 it does not.
"""

from __future__ import annotations

from trainlib import run_micro_demo


def run_demo(out, *extra: str) -> list[float]:
    rows = run_micro_demo(out, "--minutes", "4", "--run", "learn", *extra, timeout=300)
    return [float(row["reward_mean_trained"]) for row in rows]


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def test_reward_rises_with_learning_and_not_without(tmp_path):
    learned = run_demo(tmp_path / "lr", "--lr", "3e-3", "--steps", "40")
    assert len(learned) == 40
    assert mean(learned[-5:]) >= mean(learned[:5]) + 0.3, learned

    frozen = run_demo(tmp_path / "lr0", "--lr", "0", "--steps", "15")
    assert len(frozen) == 15
    assert mean(frozen[-5:]) < mean(frozen[:5]) + 0.1, frozen
    assert (tmp_path / "lr" / "reward.png").stat().st_size > 0
