"""Chaos: a scale-down (SIGTERM) never discards work. Consumers holding rollouts longer than
their drain grace are stopped again and again: what fits in the grace finishes, the rest is
requeued with its attempts intact and never dead-lettered (docs/operations.md, "Autoscaling
on Kubernetes")."""

from __future__ import annotations

import pytest
import scenarios

pytestmark = pytest.mark.chaos


@pytest.mark.timeout(150)
async def test_scale_downs_finish_or_requeue_rollouts_and_never_dead_letter_them(
    nats_server, tmp_path, capsys
):
    row = await scenarios.scale_down(nats_server, tmp_path, drains=4)
    with capsys.disabled():
        print(f"\n{row}")
    row.check()  # nothing lost, one trajectory each, no dead letter, no error
    assert row.stored == row.jobs == 8
    # the short jobs finished within the first grace (run once); the long ones ran once per
    # scale-down and once more to the end
    assert row.rerun == 4 and row.extra_runs == 4 * 4
