"""Chaos: a single-node broker crashed and restarted, paused past the ack wait, or out of
room, mid-batch (docs/reliability.md, "Chaos runs")."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.chaos


def show(capsys, row) -> None:
    with capsys.disabled():
        print(f"\n{row}")


@pytest.mark.timeout(240)
async def test_broker_sigkill_and_restart_mid_batch(nats_server, tmp_path, capsys):
    row = await scenarios.broker_restart(nats_server, tmp_path, jobs=400)
    show(capsys, row)
    row.check()
    assert row.stored == row.jobs == 400 and row.in_flight > 0


@pytest.mark.timeout(240)
async def test_broker_paused_longer_than_the_ack_wait(nats_server, tmp_path, capsys):
    row = await scenarios.broker_pause(nats_server, tmp_path, jobs=400)
    show(capsys, row)
    row.check()
    assert row.stored == row.jobs == 400 and row.in_flight > 0


@pytest.mark.timeout(180)
async def test_a_full_store_refuses_writes_and_loses_nothing(nats_server, tmp_path, capsys):
    row = await scenarios.store_full(nats_server, tmp_path, jobs=200)
    show(capsys, row)
    row.check()
    assert row.stored == row.jobs == 200 and row.rerun == 0
