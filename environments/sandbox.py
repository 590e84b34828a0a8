"""A resource sandbox for shell commands: one per session, one ``bash -c`` subprocess per command.

What a command gets (docs/design.md, "### shell"): its own working directory (removed at close),
an empty environment (a minimal ``PATH``, ``HOME``, ``LANG``: nothing of the worker's), stdin
from /dev/null, and rlimits on CPU seconds, address space, file size, open files and core
dumps. The worker enforces the wall time and the output cap itself: it reads the output
incrementally and kills the command's process group past either. How far the rest goes
depends on the host, probed once (``isolation()``) and logged:

- ``uid`` (the worker is root): every session leases its own unprivileged uid from a range
  (a lock file per uid, so workers on one machine never share one), so ``RLIMIT_NPROC`` counts
  that session's processes only and stops a fork bomb (root ignores it); the session directory
  is that uid's, mode 0700, so sessions cannot read each other's files or the worker's
  ``/proc/<pid>/environ``; every command gets a fresh network namespace (only a down loopback),
  unless the host refuses ``unshare`` (a container without CAP_SYS_ADMIN); ``no_new_privs``
  keeps setuid binaries from raising privileges. Close kills every process of the uid.
- ``userns`` (not root, user namespaces allowed): every command runs in a fresh user and
  network namespace; ``RLIMIT_NPROC`` then counts the processes of that namespace (Linux >= 5.14),
  so fork bombs stop too, but sessions share the worker's uid: no file isolation between them.
- ``rlimits`` (neither): the rlimits, wall time and output cap only; no process limit, no
  network isolation.

This limits resources; it is not a security boundary against hostile code (the kernel, the
file system and world-readable files are shared).

The preparation runs in the forked child before ``exec`` (``preexec_fn``): only C-level calls
bound in advance, no imports, locks or logging, which is what makes it safe in a threaded worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import fcntl
import functools
import os
import resource
import secrets
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import structlog

log = structlog.get_logger("agentarium.environments")

CLONE_NEWNET = 0x40000000
CLONE_NEWUSER = 0x10000000
PR_SET_NO_NEW_PRIVS = 38
PR_SET_CHILD_SUBREAPER = 36
SHELL = "/bin/bash"
PATH = "/usr/local/bin:/usr/bin:/bin"
# Unused by distributions and systemd (its table: 0x70000000-0x7FFFFFFF is unallocated).
DEFAULT_UID_BASE = 0x70000000
DEFAULT_UID_COUNT = 65536
KIB, MIB = 1024, 1024 * 1024


class SandboxError(RuntimeError):
    """The sandbox could not be set up (no free uid, an unsafe base directory)."""


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per command: ``cpu_s``, ``wall_s``, ``memory_bytes`` (address space, per process),
    ``file_size_bytes``, ``output_bytes`` (kept, then the command is stopped), ``nofile``;
    per session: ``nproc`` (processes at once, where the host enforces it)."""

    cpu_s: int = 10
    wall_s: float = 30.0
    memory_bytes: int = 512 * MIB
    file_size_bytes: int = 64 * MIB
    output_bytes: int = 64 * KIB
    nproc: int = 64
    nofile: int = 256

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_bytes", "file_size_bytes", "output_bytes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0")
        if self.nproc < 2 or self.nofile < 16:
            raise ValueError("SandboxLimits: nproc must be >= 2 and nofile >= 16")

    def rlimits(self, *, nproc: bool) -> list[tuple[int, tuple[int, int]]]:
        # CPU: SIGXCPU at the soft limit, SIGKILL one second later if the command ignores it.
        out = [
            (resource.RLIMIT_CPU, (self.cpu_s, self.cpu_s + 1)),
            (resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes)),
            (resource.RLIMIT_FSIZE, (self.file_size_bytes, self.file_size_bytes)),
            (resource.RLIMIT_NOFILE, (self.nofile, self.nofile)),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if nproc:
            out.append((resource.RLIMIT_NPROC, (self.nproc, self.nproc)))
        return out


@dataclass(frozen=True)
class Isolation:
    """What this host lets the sandbox enforce beyond the rlimits, wall time and output cap."""

    mode: str  # "uid", "userns" or "rlimits"
    network: bool  # commands have no network
    nproc: bool  # the process limit holds (fork bombs stop)
    sessions_apart: bool  # sessions cannot read each other's files or the worker's environ

    def as_dict(self) -> dict:
        return {
            "mode": self.mode,
            "network_isolated": self.network,
            "nproc_limited": self.nproc,
            "sessions_apart": self.sessions_apart,
        }


@dataclass(frozen=True)
class CommandResult:
    """One command's outcome. ``stopped`` says why the worker killed it: "wall", "output", or
    "background" (the command ended but a process that left its group kept the output open)."""

    exit_code: int  # negative: killed by that signal
    output: str  # stdout and stderr interleaved, at most output_bytes of it
    output_bytes: int  # how much the command wrote before it ended or was stopped
    truncated: bool
    stopped: str | None
    seconds: float


@functools.cache
def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _preexec(
    mode: str, network: bool, limits: SandboxLimits, uid: int | None
) -> Callable[[], None]:
    """The child's preparation, run after fork: every value and function bound beforehand."""
    libc = _libc()
    unshare, prctl = libc.unshare, libc.prctl
    setrlimit, get_errno = resource.setrlimit, ctypes.get_errno
    setgroups, setgid, setuid = os.setgroups, os.setgid, os.setuid
    write, open_, close, O_WRONLY = os.write, os.open, os.close, os.O_WRONLY
    rlimits = limits.rlimits(nproc=mode != "rlimits")
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


def _probe(mode: str, network: bool) -> bool:
    """Whether a command starts in this mode here (as the unprivileged ``nobody`` for "uid")."""
    uid = 65534 if mode == "uid" else None
    try:
        done = subprocess.run(
            ["/bin/true"],
            preexec_fn=_preexec(mode, network, SandboxLimits(), uid),
            env={},
            stdin=subprocess.DEVNULL,
            capture_output=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


_PROBE_LOCK = threading.Lock()


def isolation() -> Isolation:
    """What this host enforces (probed once per process, logged once)."""
    with _PROBE_LOCK:
        return _isolation()


@functools.cache
def _isolation() -> Isolation:
    found = Isolation("rlimits", False, nproc=False, sessions_apart=False)
    if os.geteuid() == 0 and _probe("uid", True):
        found = Isolation("uid", True, nproc=True, sessions_apart=True)
    elif os.geteuid() == 0 and _probe("uid", False):
        found = Isolation("uid", False, nproc=True, sessions_apart=True)
    elif _probe("userns", True):
        found = Isolation("userns", True, nproc=True, sessions_apart=False)
    if found.mode == "uid":
        # Orphans of commands come to this process, not to an init that may never reap them
        # (a Python PID 1 in a container): a zombie still counts against its uid's nproc.
        _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    log.info("shell sandbox", **found.as_dict())
    missing = [
        what
        for what, ok in (
            ("no network isolation", found.network),
            ("no process limit (fork bombs are not stopped)", found.nproc),
            (
                "sessions share the worker's uid (no file isolation between them)",
                found.sessions_apart,
            ),
        )
        if not ok
    ]
    if missing:
        fix = (
            "allow unshare(CLONE_NEWNET): give the container CAP_SYS_ADMIN"
            if found.mode == "uid"
            else "run the worker as root for every limit"
        )
        log.warning("shell sandbox degraded: " + "; ".join(missing) + "; " + fix)
    return found


def _owned_dir(path: Path, mode: int) -> Path:
    """Create ``path`` (or accept it) only if it is ours and not writable by others."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = path.lstat()
    if st.st_uid != os.geteuid() or not path.is_dir() or path.is_symlink():
        raise SandboxError(
            f"{path} is not a directory owned by this user: remove it or pass base_dir"
        )
    os.chmod(path, mode)
    return path


def default_uid_lock_dir() -> Path:
    """One directory per machine (not per base_dir), so every worker sees every lease."""
    run = Path("/run")
    return (
        run if run.is_dir() and os.access(run, os.W_OK) else Path("/tmp")
    ) / "agentarium-shell-uids"


def default_base_dir() -> Path:
    suffix = "" if os.geteuid() == 0 else f"-{os.geteuid()}"
    return Path(tempfile.gettempdir()) / f"agentarium-shell{suffix}"


class _UidLease:
    """An unprivileged uid of the range held for one session: an exclusive ``flock`` on a file
    per uid, so the sessions of every worker process on the machine get different uids. The
    lowest free uid is taken, so lock files stay as many as sessions ever held at once."""

    held: set[int] = set()  # by this process: skipped without a system call

    def __init__(self, lock_dir: Path, base: int, count: int) -> None:
        for uid in range(base, base + count):
            if uid in self.held:
                continue
            fd = os.open(lock_dir / f"{uid}.lock", os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
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


def _pids_of(uid: int) -> list[int]:
    """Live (not zombie) processes owned by ``uid``."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid or _state(name) == b"Z":
                continue
        except (OSError, IndexError):
            continue
        pids.append(int(name))
    return pids


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


class _Capture(asyncio.Protocol):
    """Keeps the first ``cap`` bytes of the output pipe and counts the rest; futures for the
    output passing the cap and for the pipe's end (every writer gone)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, cap: int) -> None:
        self.cap, self.kept, self.seen = cap, bytearray(), 0
        self.over, self.eof = loop.create_future(), loop.create_future()

    def data_received(self, data: bytes) -> None:
        self.seen += len(data)
        self.kept.extend(data[: max(0, self.cap - len(self.kept))])
        if self.seen > self.cap and not self.over.done():
            self.over.set_result(None)

    def eof_received(self) -> bool:
        self.connection_lost(None)
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.eof.done():
            self.eof.set_result(None)


def _exit_future(loop: asyncio.AbstractEventLoop, pid: int) -> asyncio.Future:
    """Done when ``pid`` (our child, not yet reaped) exits; it is not reaped here."""
    exited = loop.create_future()
    fd = os.pidfd_open(pid)

    def cleanup(_: asyncio.Future) -> None:
        loop.remove_reader(fd)
        os.close(fd)

    def ready() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(fd, ready)
    exited.add_done_callback(cleanup)
    return exited


def _remove_tree(path: Path) -> None:
    """rmtree, after making every directory (never a symlink's target) ours to empty again:
    a command may have left one unreadable (chmod 000), which stops a non-root worker."""
    with contextlib.suppress(OSError):
        os.chmod(path, 0o700)
    for root, dirs, _ in os.walk(path):  # top-down: each directory opened after its chmod
        for name in dirs:
            child = os.path.join(root, name)
            if not os.path.islink(child):
                with contextlib.suppress(OSError):
                    os.chmod(child, 0o700)
    shutil.rmtree(path)


class Sandbox:
    """One session's working directory and the commands run in it. ``await Sandbox.open()``,
    ``await run(...)`` any number of times (concurrently too), ``await close()`` once."""

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        base_dir: str | Path | None = None,
        uid_base: int = DEFAULT_UID_BASE,
        uid_count: int = DEFAULT_UID_COUNT,
        uid_lock_dir: str | Path | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.isolation = isolation()
        base = _owned_dir(Path(base_dir) if base_dir else default_base_dir(), 0o711)
        self._lease: _UidLease | None = None
        if self.isolation.mode == "uid":
            locks = _owned_dir(Path(uid_lock_dir or default_uid_lock_dir()), 0o700)
            self._lease = _UidLease(locks, uid_base, uid_count)
        self.uid = self._lease.uid if self._lease else None
        self.path = base / f"s-{secrets.token_hex(8)}"
        self.path.mkdir(mode=0o700)
        if self.uid is not None:
            os.chown(self.path, self.uid, self.uid)
        self.env = {"PATH": PATH, "HOME": str(self.path), "TMPDIR": str(self.path)}
        self.env |= {"LANG": "C.UTF-8", "TERM": "dumb", "USER": "sandbox", "SHELL": SHELL}
        self._preexec = _preexec(self.isolation.mode, self.isolation.network, self.limits, self.uid)
        self.closed = False

    @classmethod
    async def open(cls, **options) -> Sandbox:
        """Build one; a uid left with processes by an earlier crash is cleaned first."""
        await asyncio.to_thread(isolation)  # the first call probes the host
        box = cls(**options)
        if box.uid is not None:
            await kill_uid(box.uid)
        return box

    async def run(self, command: str, args: Sequence[str] = ()) -> CommandResult:
        """Run ``bash -c command`` (``args`` as $1, $2, ...) in the session directory."""
        if self.closed:
            raise SandboxError("the sandbox is closed")
        loop, limits, started = asyncio.get_running_loop(), self.limits, time.monotonic()
        try:
            # Popen, not asyncio's subprocess: its Process.wait reports the exit only once the
            # pipe closes (too late when a background process holds it), and the pid must be
            # in _LEADERS before anything can await (reap_orphans must never take it).
            proc = subprocess.Popen(
                [SHELL, "-c", command, "bash", *args],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=self.path,
                env=self.env,
                start_new_session=True,  # its own process group: killed as one
                preexec_fn=self._preexec,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            # EAGAIN: the session's uid is at its process limit; E2BIG; a NUL byte (ValueError)
            text = f"the command could not start: {exc}"
            return CommandResult(126, text, 0, False, None, time.monotonic() - started)
        _LEADERS.add(proc.pid)
        exited = _exit_future(loop, proc.pid)
        capture = _Capture(loop, limits.output_bytes)
        stopped: str | None = None
        transport = None
        try:
            transport, _ = await loop.connect_read_pipe(lambda: capture, proc.stdout)
            done, _ = await asyncio.wait(
                {capture.over, exited}, timeout=limits.wall_s, return_when=FIRST_COMPLETED
            )
            if capture.over in done:
                stopped = "output"
            elif not done:
                stopped = "wall"
            else:
                # It ended: end what it left in the background, then take what is still in the
                # pipe. A process that left the group (setsid) and holds the pipe is cut off.
                self._kill_group(proc.pid)
                left = max(0.0, started + limits.wall_s - time.monotonic())
                done, _ = await asyncio.wait(
                    {capture.eof, capture.over}, timeout=min(left, 1.0), return_when=FIRST_COMPLETED
                )
                if capture.over in done:
                    stopped = "output"
                elif not done:
                    stopped = "background"
        finally:
            self._kill_group(proc.pid)
            if transport is not None:
                transport.close()
            if stopped in ("wall", "output") and self.uid is not None:
                await kill_uid(self.uid)  # also what left the group (setsid)
            await asyncio.wait({exited}, timeout=5.0)  # SIGKILLed: only a stuck kernel call waits
            stuck = not exited.done()
            exited.cancel()
            code = await asyncio.to_thread(proc.wait) if stuck else proc.wait()
            _LEADERS.discard(proc.pid)
            if proc.stdout:
                proc.stdout.close()
            if self.uid is not None:
                reap_orphans()
        return CommandResult(
            exit_code=code,
            output=capture.kept.decode("utf-8", errors="replace"),
            output_bytes=capture.seen,
            truncated=capture.seen > limits.output_bytes,
            stopped=stopped,
            seconds=time.monotonic() - started,
        )

    @staticmethod
    def _kill_group(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    async def kill_all(self) -> None:
        """Kill every process the session left running (uid mode; elsewhere each command's
        process group is already gone when it returns)."""
        if self.uid is not None:
            await kill_uid(self.uid)

    async def close(self) -> None:
        """Kill what is left of the session's processes, remove its directory, free its uid."""
        if self.closed:
            return
        self.closed = True
        try:
            if self.uid is not None:
                await kill_uid(self.uid)
            try:
                await asyncio.to_thread(_remove_tree, self.path)
            except OSError as exc:
                log.warning(
                    "a sandbox directory could not be removed", path=str(self.path), error=str(exc)
                )
        finally:
            if self._lease:
                self._lease.release()
