"""Chaos: the whole LLM fleet down mid-batch, consumers as processes (docs/reliability.md,
"Chaos runs"); tests/test_fleet.py has the fleet handling's own tests."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(180)
async def test_fleet_down_mid_batch_holds_every_job(nats_server, tmp_path, capsys):
    row = await scenarios.fleet_down(nats_server, tmp_path, jobs=300, outage_s=5.0, probe_s=0.5)
    with capsys.disabled():
        print(f"\n{row}")
    row.check()  # no error trajectory, no dead letter
    assert row.stored == row.jobs == 300 and row.rerun == 0
