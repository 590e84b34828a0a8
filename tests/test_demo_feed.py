"""The demo's feed keeps the trainer fed when it drops groups as too stale."""

from __future__ import annotations

from agentarium.demo.run import DemoConfig, _groups_wanted, _starved


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


def test_the_feed_replaces_the_groups_the_trainer_dropped():
    """A loaded suite run's trainer dropped 16 groups as too stale in its first steps; a feed
    that kept only ``ahead`` steps' worth published left every later step to the starvation
    check (5.4 s a step instead of 0.5). The feed counts the dropped groups of every task."""
    args = DemoConfig(groups_per_step=8, ahead=2)
    assert _groups_wanted(args, 0, None) == 16
    row = {"step": "6", "dropped_groups/repeat": "10", "dropped_groups/next": "6", "tokens": "9"}
    assert _groups_wanted(args, 6, row) == 64 + 16
    # a task that has no row yet (an empty cell) counts nothing
    assert _groups_wanted(args, 6, {**row, "dropped_groups/next": ""}) == 64 + 10
    # dynamic sampling's refill replaces them itself: not twice
    refilled = DemoConfig(groups_per_step=8, ahead=2, dynamic_sampling=True)
    assert _groups_wanted(refilled, 6, row) == 64
