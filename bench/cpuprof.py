"""Run a Python module under a CPU-time sampling profiler switched on and off by signals.

    CPUPROF_OUT=profile.txt python bench/cpuprof.py -m agentarium consumer ...
    kill -USR1 PID   # start sampling
    kill -USR2 PID   # stop, and write collapsed stacks to CPUPROF_OUT

Why not py-spy alone: py-spy samples a thread whenever it is not idle, which includes being
runnable but waiting for a core. On a machine others share, a process is preempted most often
right after it wakes another one (a socket write to a local server), so py-spy piles those
waits onto the line that wrote, as if they were work. This profiler samples on SIGPROF, which
the kernel sends per millisecond of CPU time the process actually used (user + system), so
the samples are the process's CPU time. The handler runs on the main thread (where the event
loop and all async code run); CPU used by other threads (a sync agent's pool) is counted
against whatever the main thread runs next. Output lines are ``frame;frame;... count``,
outermost first (py-spy's raw format) with ``count`` in microseconds of CPU, read by
bench/profile_summary.py.
"""

from __future__ import annotations

import collections
import os
import runpy
import signal
import sys
import time

INTERVAL_S = 0.001
_samples: collections.Counter[tuple[str, ...]] = collections.Counter()
_names: dict[object, str] = {}
_last = 0.0


def _name(code) -> str:
    name = _names.get(code)
    if name is None:
        path = code.co_filename
        for marker in ("site-packages/", "/lib/python3.11/", "/lib/python3.12/"):
            if marker in path:
                path = path.split(marker, 1)[1]
                break
        else:
            path = os.path.relpath(path) if path.startswith("/") else path
        name = _names[code] = f"{code.co_qualname} ({path}:{{}})"
    return name


def _sample(signum, frame) -> None:
    # Signals that arrive while C code runs (a socket write, msgpack, the tokenizer) coalesce
    # into one handler call after it returns: weigh each sample by the CPU time since the
    # last one, so long C calls keep their weight (charged to the line that called them).
    global _last
    now = time.process_time()
    weight, _last = now - _last, now
    stack = []
    while frame is not None:
        stack.append(_name(frame.f_code).format(frame.f_lineno))
        frame = frame.f_back
    stack.append("thread (main)")
    _samples[tuple(reversed(stack))] += round(weight * 1e6)  # microseconds


def _start(signum, frame) -> None:
    global _last
    _samples.clear()
    _last = time.process_time()
    signal.signal(signal.SIGPROF, _sample)
    signal.setitimer(signal.ITIMER_PROF, INTERVAL_S, INTERVAL_S)


def _stop(signum, frame) -> None:
    signal.setitimer(signal.ITIMER_PROF, 0, 0)
    out = os.environ["CPUPROF_OUT"]
    with open(out + ".tmp", "w") as f:
        for stack, count in _samples.items():
            f.write(f"{';'.join(stack)} {count}\n")
    os.replace(out + ".tmp", out)


def main() -> None:
    if len(sys.argv) < 3 or sys.argv[1] != "-m":
        sys.exit(__doc__)
    signal.signal(signal.SIGUSR1, _start)
    signal.signal(signal.SIGUSR2, _stop)
    module = sys.argv[2]
    sys.argv = [module, *sys.argv[3:]]
    sys.path[0] = os.getcwd()  # as `python -m` has it, not this script's directory
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
