"""Chaos: a crashed consumer's jobs back within seconds, live long rollouts never redelivered
(docs/reliability.md, "Chaos runs").

Not marked ``chaos``: the chaos tier runs its scenarios one after another, and this one waits
three minutes on rollouts that only sleep, so it runs in the first pass instead, started first
(``long``) beside the CPU-bound tests.
"""

from __future__ import annotations

import pytest
import scenarios


@pytest.mark.long(200)
@pytest.mark.timeout(420)
async def test_a_killed_consumers_jobs_are_back_in_seconds_and_live_long_rollouts_never(
    nats_server, tmp_path, capsys
):
    """With the default ack wait (10 s), all 100 jobs of a SIGKILLed consumer are stored within
    15 s of the kill (they are redelivered 6.7-10 s after it: the last heartbeat was at most a
    third of the ack wait before), while 8 rollouts of 3 minutes on a live consumer, running
    through the kill, are delivered once each."""
    row = await scenarios.crash_recovery(nats_server, tmp_path, held=100, slow=8, rollout_s=180)
    with capsys.disabled():
        print(f"\n{row}")
    row.check()
    assert row.stored == row.jobs == 108 and row.in_flight == 100
    assert row.extra_runs == row.rerun == 100  # the killed consumer's jobs, and only them
    assert row.recovery_s <= 15.0, str(row)
