"""Chaos: the trainer SIGKILLed twice across checkpoints and resumed each time: every
trajectory trained exactly once (docs/reliability.md, "Chaos runs")."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(300)
async def test_trainer_kill_storm_trains_every_trajectory_once(nats_server, tmp_path, capsys):
    row = await scenarios.trainer_kill_storm(nats_server, tmp_path, groups=16, kills=2)
    with capsys.disabled():
        print(f"\n{row}")
    row.check()  # none lost, none trained twice, redone steps within the uncheckpointed ones
    assert row.stored == row.jobs == 64 and row.faults == 2
    assert row.extra_runs == 1  # the kill one step past its checkpoint costs that step
