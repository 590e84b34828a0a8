"""Progress lines (tqdm): in place on a terminal, plain lines in logs, nothing when unwanted."""

from __future__ import annotations

import io

from agentarium.progress import ProgressBar, StatusLine
from agentarium.schemas import Trajectory


def trajectory(status: str, reward: float | None = None) -> Trajectory:
    return Trajectory(
        job_id="j", agent="a", task_id="t", group_id="g", status=status, reward=reward
    )


def feed(bar: ProgressBar) -> None:
    for t in (trajectory("ok", 1.0), trajectory("error"), trajectory("ok", 0.0)):
        bar.update(t)
    bar.close()


def test_a_terminal_gets_one_line_rewritten_in_place_ending_with_the_totals():
    out = io.StringIO()
    feed(ProgressBar(3, stream=out, enabled=True))
    text = out.getvalue()
    assert text.startswith("\r") and text.endswith("\n") and text.count("\n") == 1
    final = text.rstrip("\n").split("\r")[-1]
    assert final.startswith("[" + "#" * 30 + "] 3/3 rollouts  ok=2 error=1 timeout=0 reward=0.500")
    assert "rollouts/s" in final


def test_logs_get_plain_lines_every_few_seconds_and_the_last_one():
    out = io.StringIO()
    feed(ProgressBar(3, label="pairs", stream=out, every_s=3600))
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert len(lines) == 2  # the first at once, then the final one; none between
    assert "1/3 pairs  ok=1 error=0" in lines[0]
    assert "3/3 pairs  ok=2 error=1 timeout=0 reward=0.500" in lines[1]


def test_off_a_terminal_without_an_interval_nothing_is_written():
    out = io.StringIO()
    feed(ProgressBar(3, stream=out))
    assert out.getvalue() == ""


def test_a_status_line_shows_free_text_beside_the_count():
    out = io.StringIO()
    line = StatusLine(10, fmt="[{bar:10}] step {n_fmt}/{total_fmt} {info}", stream=out, every_s=0)
    line.show(0, "waiting for the first step (5 rollouts stored)")
    line.show(4, "v4 reward 0.50")
    line.close()
    assert out.getvalue().splitlines() == [
        "[..........] step 0/10 waiting for the first step (5 rollouts stored)",
        "[####......] step 4/10 v4 reward 0.50",
    ]
