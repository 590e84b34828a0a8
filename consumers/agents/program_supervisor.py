"""The supervisor of one program agent's run: it starts the program and, whatever happens, leaves
no process of it behind (docs/design.md, "Program agents").

The consumer runs it as ``python -I -S program_supervisor.py CONTROL_FD GRACE UID GID DIR -- CMD...``
(standard library only, no site packages). Why a process between the
consumer and the program rather than a plain process group: a program may start processes that
leave its group (``setsid``, as shells and Node's ``detached`` do), and a consumer killed with
SIGKILL cannot kill anything. Here:

- the supervisor is a child subreaper (Linux), so every process the program starts stays below
  it, orphans included, and "every descendant" is the whole tree, read from ``/proc``;
- the program starts in a session of its own (the group fallback where there is no ``/proc``),
  as ``UID``:``GID`` when those are not -1 (the consumer is root), with ``no_new_privs`` set,
  so a setuid binary cannot take it back up;
- ``CONTROL_FD`` is a socket to the consumer. ``stop`` on it, its end (the consumer is gone,
  even killed with SIGKILL) or a SIGTERM: every descendant gets SIGTERM, then SIGKILL after
  ``GRACE`` seconds. When the program exits by itself, what it left running is stopped too.
  When the consumer is gone, the supervisor also removes ``DIR`` (the run's working directory,
  which nobody else will; ``-``: none).
- the supervisor reports on the socket, one JSON object a line: ``{"pid": N}`` once started,
  then ``{"exit": code, "stopped": bool}`` (a negative code: killed by that signal) or
  ``{"error": "..."}`` when the program could not start. stdin, stdout and stderr are the
  program's (the consumer's pipes).
"""

from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
HAS_PROC = os.path.isdir("/proc/self/task")


class Tree:
    """The program's processes: every live descendant of this one (``/proc``), or the
    program's process group where there is no ``/proc``."""

    def __init__(self, leader: int) -> None:
        self.leader = leader
        self.stop_asked = threading.Event()
        self.orphaned = False  # the consumer's end of the socket closed
        self._lock = threading.Lock()

    def pids(self) -> list[int]:
        if not HAS_PROC:
            return [self.leader]
        children: dict[int, list[int]] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat", "rb") as f:
                    state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            except (OSError, ValueError):
                continue  # gone meanwhile
            if state != b"Z":  # a zombie is dead already; it has no children left
                children.setdefault(int(ppid), []).append(int(name))
        found, stack = [], [os.getpid()]
        while stack:
            for pid in children.get(stack.pop(), ()):
                found.append(pid)
                stack.append(pid)
        return found

    def signal(self, sig: int) -> int:
        """Send ``sig`` to every process of the tree; how many there were (without ``/proc``:
        1 while the group exists, once)."""
        if not HAS_PROC:
            try:
                os.killpg(self.leader, sig)
            except (ProcessLookupError, PermissionError):
                return 0
            return 0 if sig == signal.SIGKILL else 1
        pids = self.pids()
        for pid in pids:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        return len(pids)

    def end(self, grace_s: float) -> None:
        """SIGTERM to every process, SIGKILL to those left after ``grace_s``, until none is."""
        with self._lock:
            if self.signal(signal.SIGTERM):
                deadline = time.monotonic() + grace_s
                while time.monotonic() < deadline and self.pids():
                    time.sleep(0.01)
            for _ in range(1000):  # SIGKILLed processes cannot fork: this ends in a round or two
                if not self.signal(signal.SIGKILL):
                    return
                time.sleep(0.002)

    def stop(self, grace_s: float) -> None:
        self.stop_asked.set()
        self.end(grace_s)


def _report(control: socket.socket, **fields: object) -> None:
    try:
        control.sendall(json.dumps(fields).encode() + b"\n")
    except OSError:
        pass  # the consumer is gone: nobody reads it


def _watch(control: socket.socket, tree: Tree, grace_s: float) -> None:
    """Until ``stop`` arrives or the consumer's end closes, then end the tree."""
    buffered = b""
    while b"stop" not in buffered:
        try:
            data = control.recv(64)
        except OSError:
            data = b""
        if not data:
            break
        buffered = (buffered + data)[-64:]
    tree.orphaned = b"stop" not in buffered
    tree.stop(grace_s)


def _wait(leader: int) -> int:
    """The program's wait status, reaping the orphans that come here meanwhile."""
    while True:
        pid, status = os.wait()
        if pid == leader:
            return status


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _prctl(option: int) -> None:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(option, 1, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: no subreaper, no no_new_privs
        pass


def main(argv: list[str]) -> int:
    control_fd, grace_s, uid, gid = int(argv[0]), float(argv[1]), int(argv[2]), int(argv[3])
    workdir = argv[4]
    command = argv[argv.index("--") + 1 :]
    control = socket.socket(fileno=control_fd)
    _prctl(PR_SET_CHILD_SUBREAPER)
    _prctl(PR_SET_NO_NEW_PRIVS)
    switch = uid >= 0
    try:
        program = subprocess.Popen(
            command,
            start_new_session=True,
            close_fds=True,
            user=uid if switch else None,
            group=gid if switch else None,
            extra_groups=[] if switch else None,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        _report(control, error=f"cannot start {command[0]!r}: {reason}")
        return 127
    _report(control, pid=program.pid)
    tree = Tree(program.pid)

    def on_sigterm(*_: object) -> None:
        if not tree.stop_asked.is_set():
            threading.Thread(target=tree.stop, args=(grace_s,), daemon=True).start()

    signal.signal(signal.SIGTERM, on_sigterm)
    threading.Thread(target=_watch, args=(control, tree, grace_s), daemon=True).start()
    status = _wait(program.pid)
    program.returncode = code = os.waitstatus_to_exitcode(status)
    tree.end(grace_s)  # what the program left running
    _reap()
    _report(control, exit=code, stopped=tree.stop_asked.is_set())
    if tree.orphaned and workdir != "-":
        import shutil

        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
