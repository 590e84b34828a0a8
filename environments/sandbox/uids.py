"""Session uids (as root): a lease per session, and ending a uid's processes.

A session runs as an unprivileged uid of a range held for it alone: an exclusive ``flock`` on
a file per uid in one directory per machine, so the sessions of every worker on the machine get
different uids and a crashed worker's leases free themselves. The lowest free uid is taken, so
lock files stay as many as sessions ever held at once. Nothing a session leaves is found by the
next holder of its uid: in mode ``namespaces`` a session's files and processes live in its own
namespaces, gone with them; in the weaker ``uid`` mode a lease first ends what the uid still runs
and the sweep at worker start removes what a crashed worker left (``host.sweep``).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import structlog

from .limits import SandboxError

log = structlog.get_logger("agentarium.environments")

# Unused by distributions and systemd (its table: 0x70000000-0x7FFFFFFF is unallocated).
DEFAULT_UID_BASE = 0x70000000
DEFAULT_UID_COUNT = 65536


def default_uid_lock_dir() -> Path:
    """One directory per machine (not per base_dir), so every worker sees every lease."""
    run = Path("/run")
    return (
        run if run.is_dir() and os.access(run, os.W_OK) else Path("/tmp")
    ) / "agentarium-shell-uids"


def _lock(lock_dir: Path, uid: int) -> int | None:
    """The uid's lock file, locked; None if someone holds it."""
    fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


class UidLease:
    """An unprivileged uid of the range held for one session (see the module's docstring)."""

    held: set[int] = set()  # by this process: skipped without a system call

    def __init__(self, lock_dir: Path, base: int, count: int) -> None:
        for uid in range(base, base + count):
            if uid in self.held:
                continue
            fd = _lock(lock_dir, uid)
            if fd is None:
                continue
            self.uid, self._fd = uid, fd
            self.held.add(uid)
            return
        raise SandboxError(
            f"every uid in {base}..{base + count - 1} is in use: widen the range (uid_count)"
        )

    def release(self) -> None:
        if self._fd >= 0:
            self.held.discard(self.uid)
            os.close(self._fd)  # closing the descriptor drops the lock
            self._fd = -1


@contextlib.contextmanager
def hold_if_free(lock_dir: Path, uid: int) -> Iterator[bool]:
    """Hold ``uid``'s lease for the block if no one does (the sweep removes its leftovers)."""
    fd = None if uid in UidLease.held else _lock(lock_dir, uid)
    try:
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)


_LEADERS: set[int] = set()  # live commands' first processes: Sandbox.run reaps those itself


def reap_orphans() -> int:
    """Reap zombie children of this process that belong to sandbox uids and are not a
    command's first process (``run`` waits for those): orphans of commands (uid mode)."""
    me, reaped = os.geteuid(), 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                children = [int(p) for p in f.read().split()]
        except OSError:
            continue
        for pid in children:
            if pid in _LEADERS:
                continue
            try:
                if os.stat(f"/proc/{pid}").st_uid == me or _state(pid) != b"Z":
                    continue
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    reaped += 1
            except (OSError, IndexError):
                continue
    return reaped


def _state(pid: int | str) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0]


def pids_by_uid(first: int, count: int) -> dict[int, list[int]]:
    """Live (not zombie) processes whose uid is in ``first .. first + count - 1``, by uid."""
    found: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            uid = os.stat(f"/proc/{name}").st_uid
            if not first <= uid < first + count or _state(name) == b"Z":
                continue
        except (OSError, IndexError):
            continue
        found.setdefault(uid, []).append(int(name))
    return found


def _pids_of(uid: int) -> list[int]:
    return pids_by_uid(uid, 1).get(uid, [])


async def kill_uid(uid: int, *, within_s: float = 5.0) -> int:
    """SIGKILL every process of ``uid`` until none is left; how many rounds found some."""
    rounds, deadline = 0, time.monotonic() + within_s
    while pids := _pids_of(uid):
        rounds += 1
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            log.warning("processes of a sandbox uid survive", uid=uid, left=len(pids))
            break
        await asyncio.sleep(0.005)
        reap_orphans()
    reap_orphans()
    return rounds


def kill_pids(pids: list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
