"""The demo's feed keeps the trainer fed when it drops groups as too stale."""

from __future__ import annotations

from trainlib import run_micro_demo

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


def test_a_run_that_drops_stale_groups_trains_every_step(tmp_path):
    """``--max-staleness 0`` with the feed two steps ahead: the second step's groups are
    generated on the base weights beside the first, so the trainer drops them once it has
    stepped. On an idle machine the engine takes the new weights before the next groups are
    generated, so this run does not starve without the replacement above (it passed without
    it); it checks that drops and replacements leave every step trained on current groups."""
    rows = run_micro_demo(
        tmp_path / "demo",
        "--steps", "4", "--groups-per-step", "2", "--max-staleness", "0", "--minutes", "4",
        timeout=330,
    )  # fmt: skip
    assert [int(row["step"]) for row in rows] == [1, 2, 3, 4]
    assert sum(int(row["dropped_stale"]) for row in rows) > 0  # the case it is about happened
    assert all(int(row["staleness_max"]) == 0 for row in rows)
