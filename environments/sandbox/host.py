"""What this host lets the sandbox enforce (probed once per process), and the sweep at start.

The modes, best first (docs/design.md, "The sandbox"):

- ``namespaces`` (root, bubblewrap installed, the kernel allows the namespaces): each session
  its own mount, PID, IPC, UTS and network namespaces and root file system
  (``namespaces.py``), its own uid, and, where the cgroup controllers are writable, a cgroup
  (``cgroups.py``).
- ``uid`` (root, no bubblewrap or no namespaces): a uid per session and a network namespace per
  command; the host's files, ``/tmp``, ``/dev/shm`` and process list are shared.
- ``userns`` (not root, user namespaces allowed): a user and network namespace per command;
  sessions share the worker's uid.
- ``rlimits``: the per-process limits, wall time and output cap only.

``Isolation.missing`` names each isolation the host does not give, and why; a sandbox refuses
to open while anything is missing unless the operator allowed the weaker sandbox
(``allow_weaker``: ``--option allow_weaker_sandbox=true`` for ``agentarium env serve shell``).
"""

from __future__ import annotations

import ctypes
import functools
import os
import resource
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from . import cgroups, namespaces
from .cgroups import CgroupLayout
from .limits import SandboxLimits
from .uids import hold_if_free, kill_pids, pids_by_uid

log = structlog.get_logger("agentarium.environments")

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
PR_SET_PDEATHSIG = 1
NAMESPACES = ("mount", "pid", "ipc", "uts", "net")
ALLOW_FLAG = "--option allow_weaker_sandbox=true"
SESSION_LIMITS = {
    "memory": "a memory limit for the session as a whole",
    "pids": "a process limit for the session as a whole (and the note that a fork bomb hit it)",
    "cpuacct": "the CPU time of the session as a whole",
    "cpu": "a cap on the cores the session uses at once",
}


@dataclass(frozen=True)
class Isolation:
    """What this host lets the sandbox enforce beyond the rlimits, wall time and output cap."""

    mode: str  # "namespaces", "uid", "userns" or "rlimits"
    network: bool  # commands have no network
    nproc: bool  # the process limit holds (fork bombs stop)
    sessions_apart: bool  # sessions cannot read each other's files or the worker's environ
    namespaces: tuple[str, ...] = ()  # a session's own (mode namespaces)
    cgroup: CgroupLayout = field(default_factory=CgroupLayout)
    missing: tuple[str, ...] = ()

    @property
    def disk_capped(self) -> bool:
        return self.mode == "namespaces"

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "network_isolated": self.network,
            "nproc_limited": self.nproc,
            "sessions_apart": self.sessions_apart,
            "namespaces": list(self.namespaces),
            "cgroup": self.cgroup.version,
            "session_limits": sorted(self.cgroup.places),
            "disk_capped": self.disk_capped,
            "missing": list(self.missing),
        }

    def refusal(self) -> str:
        """The one-line error of a sandbox that may not open here."""
        return (
            "the shell sandbox on this host lacks " + "; ".join(self.missing) + ". Run the "
            "worker as root with bubblewrap installed and writable cgroups (docs/design.md, "
            f"'The sandbox'), or accept the weaker sandbox with {ALLOW_FLAG}"
        )


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def legacy_preexec(
    mode: str, network: bool, limits: SandboxLimits, uid: int | None, join: list[bytes]
) -> Callable[[], None]:
    """The child's preparation in the weaker modes, run after fork: every value and function
    bound beforehand (no imports, locks or logging: safe in a threaded worker)."""
    libc = _libc()
    unshare, prctl = libc.unshare, libc.prctl
    setrlimit, get_errno = resource.setrlimit, ctypes.get_errno
    setgroups, setgid, setuid = os.setgroups, os.setgid, os.setuid
    write, open_, close, O_WRONLY = os.write, os.open, os.close, os.O_WRONLY
    rlimits = limits.rlimits(nproc=mode != "rlimits", cpu_backstop=False)
    # userns: map our own uid and gid, so files keep their owner; setgroups is denied first.
    maps = [
        (b"/proc/self/setgroups", b"deny"),
        (b"/proc/self/uid_map", f"{os.getuid()} {os.getuid()} 1".encode()),
        (b"/proc/self/gid_map", f"{os.getgid()} {os.getgid()} 1".encode()),
    ]
    flags = (CLONE_NEWUSER | CLONE_NEWNET) if mode == "userns" else CLONE_NEWNET

    def child() -> None:
        if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        for path in join:
            fd = open_(path, O_WRONLY)
            try:
                write(fd, b"0")
            finally:
                close(fd)
        if mode != "rlimits" and network and unshare(flags) != 0:
            raise OSError(get_errno(), "unshare")
        if mode == "userns":
            for path, text in maps:
                fd = open_(path, O_WRONLY)
                try:
                    write(fd, text)
                finally:
                    close(fd)
        for which, value in rlimits:
            setrlimit(which, value)
        if uid is not None:
            setgroups([])
            setgid(uid)
            setuid(uid)

    return child


def enter_preexec(
    limits: SandboxLimits, join: list[bytes], *, cpu_backstop: bool
) -> Callable[[], None]:
    """The child's preparation in mode namespaces, before ``exec nsenter``: no new privileges,
    die with the worker, join the session's cgroup, the per-process limits. (nsenter, still
    root, enters the namespaces and switches to the session's uid.)"""
    prctl, get_errno = _libc().prctl, ctypes.get_errno
    setrlimit, write, open_, close, O_WRONLY = (
        resource.setrlimit,
        os.write,
        os.open,
        os.close,
        os.O_WRONLY,
    )
    rlimits = limits.rlimits(nproc=True, cpu_backstop=cpu_backstop)

    def child() -> None:
        if prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
        prctl(PR_SET_PDEATHSIG, 9, 0, 0, 0)  # SIGKILL when the worker dies
        for path in join:
            fd = open_(path, O_WRONLY)
            try:
                write(fd, b"0")
            finally:
                close(fd)
        for which, value in rlimits:
            setrlimit(which, value)

    return child


def _probe_legacy(mode: str, network: bool) -> bool:
    """Whether a command starts in this weaker mode here (as ``nobody`` for "uid")."""
    uid = 65534 if mode == "uid" else None
    try:
        done = subprocess.run(
            ["/bin/true"],
            preexec_fn=legacy_preexec(mode, network, SandboxLimits(), uid, []),
            env={},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def _probe_namespaces() -> str:
    """ "" if bwrap builds a session's root and runs a command in it here, else why not."""
    if os.geteuid() != 0:
        return "the worker is not root"
    why = namespaces.available()
    if why:
        return why
    limits = SandboxLimits(disk_bytes=2**20, tmp_bytes=2**20)
    args = namespaces.bwrap_args(limits, (), {})
    try:
        done = subprocess.run(
            [namespaces.BWRAP, *args, "--", "/bin/true"],
            env={"PATH": namespaces.PATH},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bwrap could not run: {exc}"
    if done.returncode != 0:
        text = done.stderr.decode(errors="replace").strip().splitlines()
        return f"bwrap failed here: {text[-1] if text else done.returncode}"
    return ""


_PROBE_LOCK = threading.Lock()


def isolation() -> Isolation:
    """What this host enforces (probed once per process, logged once)."""
    with _PROBE_LOCK:
        return _isolation()


@functools.cache
def _isolation() -> Isolation:
    layout = cgroups.find_layout()
    missing = [
        f"{what} (cgroup {role}: {layout.problems[role]})"
        for role, what in SESSION_LIMITS.items()
        if role in layout.problems
    ]
    why_not = _probe_namespaces()
    if not why_not:
        found = Isolation("namespaces", True, True, True, NAMESPACES, layout, tuple(missing))
    else:
        root = os.geteuid() == 0
        if root and _probe_legacy("uid", True):
            found = Isolation("uid", True, nproc=True, sessions_apart=True)
        elif root and _probe_legacy("uid", False):
            found = Isolation("uid", False, nproc=True, sessions_apart=True)
        elif _probe_legacy("userns", True):
            found = Isolation("userns", True, nproc=True, sessions_apart=False)
        else:
            found = Isolation("rlimits", False, nproc=False, sessions_apart=False)
        missing = [
            "a mount, PID, IPC and UTS namespace per session, so the host's files, /tmp, "
            f"/dev/shm and processes are shared, and no disk cap ({why_not})",
            *(["a network namespace"] if not found.network else []),
            *(["a process limit"] if not found.nproc else []),
            *(["a uid per session"] if not found.sessions_apart else []),
            *missing,
        ]
        found = Isolation(
            found.mode,
            found.network,
            found.nproc,
            found.sessions_apart,
            (),
            layout if root else CgroupLayout(),
            tuple(missing),
        )
    if found.mode == "uid":
        # Orphans of commands come to this process, not to an init that may never reap them
        # (a Python PID 1 in a container): a zombie still counts against its uid's nproc.
        _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    log.info("shell sandbox", **found.as_dict())
    if found.missing:
        log.warning("shell sandbox degraded: " + "; ".join(found.missing))
    return found


def default_base_dir() -> Path:
    """Where the weaker modes make the sessions' folders."""
    suffix = "" if os.geteuid() == 0 else f"-{os.geteuid()}"
    return Path(tempfile.gettempdir()) / f"agentarium-shell{suffix}"


def sweep(*, uid_lock_dir: Path, uid_base: int, uid_count: int, base_dir: Path | None) -> dict:
    """At worker start, what crashed workers left: session cgroups, processes of the uid range
    and (weaker modes) session folders, each only if no live worker holds its uid."""
    found = isolation()
    counts = {"cgroups": 0, "uids_killed": 0, "folders": 0}
    if os.geteuid() != 0 or not uid_lock_dir.is_dir():
        return counts

    def hold(uid: int):
        return hold_if_free(uid_lock_dir, uid)

    counts["cgroups"] = cgroups.sweep(found.cgroup, hold)
    for uid, pids in pids_by_uid(uid_base, uid_count).items():
        with hold(uid) as free:
            if free:
                kill_pids(pids)
                counts["uids_killed"] += 1
    base_dir = base_dir or default_base_dir()
    if base_dir.is_dir():
        for child in base_dir.glob("s-*"):
            try:
                owner = child.lstat().st_uid
            except OSError:
                continue
            if child.is_symlink() or not uid_base <= owner < uid_base + uid_count:
                continue
            with hold(owner) as free:
                if free:
                    shutil.rmtree(child, ignore_errors=True)
                    counts["folders"] += 1
    if any(counts.values()):
        log.info("shell sandbox: swept what crashed workers left", **counts)
    return counts
