"""Chaos: a 3-node cluster with R3 streams losing a follower, then having its TASKS leader
cut off by a black-holing proxy (docs/reliability.md, "Chaos runs"). The leader kill is
tests/test_cluster.py's; bench/chaos.py runs all three."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(300)
async def test_follower_kill_and_a_partitioned_leader_lose_nothing(tmp_path, capsys):
    rows = await scenarios.cluster_faults(
        tmp_path, faults=("follower kill", "partition"), jobs=300, down_s=6.0
    )
    with capsys.disabled():
        print("", *rows, sep="\n")
    for row in rows:
        row.check()
        assert row.stored == row.jobs == 300
