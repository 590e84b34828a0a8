"""Chaos: consumer processes SIGKILLed while they work (docs/reliability.md, "Chaos runs")."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(240)
async def test_consumer_kill_storm_loses_nothing_and_reruns_only_what_was_in_flight(
    nats_server, tmp_path, capsys
):
    row = await scenarios.consumer_kill_storm(nats_server, tmp_path, jobs=1500, kills=4)
    with capsys.disabled():
        print(f"\n{row}")
    row.check()
    assert row.faults == 4 and row.in_flight > 0  # every kill caught work in flight
    assert row.stored == row.jobs == 1500
