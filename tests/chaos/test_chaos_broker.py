"""Chaos: a single-node broker crashed and restarted, or paused past the ack wait, mid-batch
(docs/reliability.md, "Chaos runs")."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(240)
async def test_broker_sigkill_and_restart_mid_batch(nats_server, tmp_path, capsys):
    row = await scenarios.broker_restart(nats_server, tmp_path, jobs=600)
    with capsys.disabled():
        print(f"\n{row}")
    row.check()
    assert row.stored == row.jobs == 600


@pytest.mark.timeout(240)
async def test_broker_paused_longer_than_the_ack_wait(nats_server, tmp_path, capsys):
    row = await scenarios.broker_pause(nats_server, tmp_path, jobs=600)
    with capsys.disabled():
        print(f"\n{row}")
    row.check()
    assert row.stored == row.jobs == 600
