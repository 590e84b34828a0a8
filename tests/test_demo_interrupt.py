"""Ctrl-C in the terminal running ``agentarium demo``: the demo and all its processes get
SIGINT (one process group); the demo stops within seconds, prints no traceback, exits 130 and
still writes metrics.csv and reward.png for the steps done (the README promises both).

The demo stops its children together (one 30 s grace, then SIGKILL) and its broker last (10 s,
then SIGKILL): about 45 s at worst, so the 120 s waited here is a generous bound."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from trainlib import MICRO_TASK


def _start_sigint_ignored() -> None:
    # Started as a script's background job is (`cmd &` without job control; ops/test.sh's
    # tiers, so every test it runs): SIGINT ignored. The demo must stop on Ctrl-C all the same,
    # as its children do; it then runs exactly as when a terminal starts it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _start_demo(out: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "agentarium", "demo", "--out", str(out), *MICRO_TASK,
         "--steps", "300", "--minutes", "8"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        preexec_fn=_start_sigint_ignored,
    )  # fmt: skip


def _interrupted(out: Path, ready, how: str) -> subprocess.Popen:
    """Start the demo, signal it (``ctrl-c``: SIGINT to its whole group, as a terminal does;
    ``sigterm``: SIGTERM to the demo alone, as a supervisor does) at the first line ``ready``
    accepts, and check it stopped as interrupted: status 130, no traceback."""
    proc = _start_demo(out)
    try:
        seen = []
        for line in proc.stdout:
            seen.append(line)
            if ready(line):
                break
        assert proc.poll() is None, "".join(seen)
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, "".join(seen) + rest + err
    assert "Traceback" not in err and "Traceback" not in rest, err
    assert "interrupted: stopping the demo's processes" in rest
    return proc


def _assert_nothing_left(proc: subprocess.Popen, out: Path) -> None:
    with pytest.raises(ProcessLookupError):  # nothing of the demo left running
        os.killpg(proc.pid, 0)
    # nor its nats-server, which has a process group of its own (a Ctrl-C does not stop it
    # before the trainer has acked its checkpoint through it); its log lines start "[pid]"
    pid = re.match(r"\[(\d+)\]", (out / "logs" / "nats-server.log").read_text()).group(1)
    try:  # gone, or its pid reused by another process since
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except FileNotFoundError:
        return
    assert str(out) not in cmdline, f"the demo's nats-server ({pid}) still runs"


@pytest.mark.long(45)
@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_an_interrupted_demo_stops_cleanly_and_reports_what_it_trained(how, tmp_path):
    out = tmp_path / "demo"
    # wait for a trained step, not for a time (printed every 5 s: any step after 0)
    proc = _interrupted(out, lambda line: re.search(r"step [1-9]\d*/300", line), how)
    assert (out / "metrics.csv").stat().st_size > 0 and (out / "reward.png").stat().st_size > 0
    _assert_nothing_left(proc, out)


@pytest.mark.long(20)
def test_ctrl_c_while_the_demo_starts_stops_it_too(tmp_path):
    """Ctrl-C as soon as the broker is up: the engine and the trainer are being started and
    load torch and the model, before they handle signals themselves; the demo still stops them
    all and exits 130 without a traceback."""
    out = tmp_path / "demo"
    # "watch it live:" is printed once the broker listens
    proc = _interrupted(out, lambda line: line.startswith("watch it live:"), "ctrl-c")
    _assert_nothing_left(proc, out)


@pytest.mark.long(45)
def test_a_child_that_dies_fails_the_demo_naming_it(tmp_path):
    """The consumer killed under a running demo (as the OOM killer would): the demo stops the
    rest and exits 1 naming the child, its signal and its log, instead of feeding tasks no one
    runs until --minutes ends."""
    out = tmp_path / "demo"
    proc = _start_demo(out)
    try:
        for line in proc.stdout:
            if re.search(r"step [1-9]\d*/300", line):
                break
        consumers = subprocess.run(
            ["pgrep", "-P", str(proc.pid), "-f", "agentarium consumer"],
            capture_output=True, text=True,
        ).stdout.split()  # fmt: skip
        assert len(consumers) == 1, consumers
        os.kill(int(consumers[0]), signal.SIGKILL)
        rest, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 1, rest + err
    assert "error: consumer-0 exited (signal 9) while the demo needed it" in err, err
    assert "Traceback" not in err and (out / "metrics.csv").exists()
    _assert_nothing_left(proc, out)
