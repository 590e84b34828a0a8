"""Chaos: consumer processes SIGKILLed while they work, and rollouts that outlive the ack wait
(docs/reliability.md, "Chaos runs")."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.chaos


def show(capsys, row) -> None:
    with capsys.disabled():
        print(f"\n{row}")


@pytest.mark.timeout(240)
async def test_consumer_kill_storm_loses_nothing_and_reruns_only_what_was_in_flight(
    nats_server, tmp_path, capsys
):
    row = await scenarios.consumer_kill_storm(nats_server, tmp_path, jobs=1200, kills=3)
    show(capsys, row)
    row.check()
    assert row.faults == 3 and row.in_flight > 0  # the kills caught work in flight
    assert row.stored == row.jobs == 1200


@pytest.mark.timeout(120)
async def test_rollouts_longer_than_the_ack_wait_are_never_redelivered(
    nats_server, tmp_path, capsys
):
    row = await scenarios.slow_rollouts(nats_server, tmp_path, jobs=24)
    show(capsys, row)
    row.check()
    assert row.rerun == 0 and row.stored == 24
