"""The demo's feed keeps the trainer fed when it drops groups as too stale."""

from __future__ import annotations

from agentarium.demo.run import _starved


def test_a_trainer_with_every_job_done_and_no_step_for_three_steps_time_is_starved():
    """The multi-task suite run that stalled at step 6 of 60: all 512 jobs published had
    trajectories, the trainer had trained 48 groups and dropped the other 16 as too stale,
    and the feed, which follows the trainer's steps, published nothing more."""
    waiting = (6, 100.0)
    # jobs still running, or a new step: the clock starts again
    assert _starved(waiting, step=6, done=False, step_s=0.3, now=200.0) == ((6, 200.0), False)
    assert _starved(waiting, step=7, done=True, step_s=0.3, now=200.0) == ((7, 200.0), False)
    # all done: starved after three steps' time, 5 s at least
    assert _starved(waiting, step=6, done=True, step_s=0.3, now=104.0) == (waiting, False)
    assert _starved(waiting, step=6, done=True, step_s=0.3, now=105.5) == ((6, 105.5), True)
    assert _starved(waiting, step=6, done=True, step_s=20.0, now=159.0) == (waiting, False)
    assert _starved(waiting, step=6, done=True, step_s=20.0, now=161.0)[1]
    # before the first step (no step time yet): 30 s
    assert not _starved((0, 0.0), step=0, done=True, step_s=None, now=29.0)[1]
    assert _starved((0, 0.0), step=0, done=True, step_s=None, now=31.0)[1]
