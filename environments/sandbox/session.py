"""One session's sandbox: ``Sandbox.open()``, ``run(command)`` any number of times, ``close()``.

What a command gets (docs/design.md, "The sandbox"): a fresh ``bash -c`` in the session's
working directory, an empty environment (a minimal ``PATH``, ``HOME``, ``LANG``: nothing of the
worker's), stdin from /dev/null, the per-process rlimits, and the worker's own wall-time and
output caps (it reads the output incrementally and kills the command past either). Where the
host gives them (``host.isolation()``), the session also has its own namespaces and root file
system (``namespaces.py``), its own uid (``uids.py``) and a cgroup (``cgroups.py``): then every
process a command started ends with it, the session's CPU time per command is watched as a
whole, and what fired (memory, process limit, full disk) is named in the result.

The child's preparation runs after fork, before ``exec`` (``preexec_fn``): only calls bound in
advance, no imports, locks or logging, which is what makes it safe in a threaded worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from asyncio import FIRST_COMPLETED
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import structlog

from . import uids
from .cgroups import SessionCgroup
from .host import Isolation, default_base_dir, enter_preexec, isolation, legacy_preexec
from .limits import CommandResult, SandboxError, SandboxLimits
from .namespaces import WORKDIR, Holder
from .uids import DEFAULT_UID_BASE, DEFAULT_UID_COUNT, UidLease, default_uid_lock_dir, kill_uid

log = structlog.get_logger("agentarium.environments")

SHELL = "/bin/bash"
PATH = "/usr/local/bin:/usr/bin:/bin"
# The checkout's root, or the installed package (both hold examples/ with the tasks' answers):
# hidden from a session even where a system folder would show it (a package under /usr).
PROJECT = Path(__file__).resolve().parents[2]
CPU_CHECK_MIN_S = 0.02
# the session's tmpfs folders, as CommandResult.hit names them when full
FULL = (("disk", WORKDIR), ("tmp", "/tmp"), ("shm", "/dev/shm"))


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
    ``await run(...)`` any number of times (concurrently too), ``await close()`` once.

    ``hide``: host paths the session must not see even where a system folder would show them
    (the project's own folder is always hidden). ``allow_weaker``: open even where the host
    lacks some isolation (``Isolation.missing``); otherwise that is a ``SandboxError``."""

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        base_dir: str | Path | None = None,
        uid_base: int = DEFAULT_UID_BASE,
        uid_count: int = DEFAULT_UID_COUNT,
        uid_lock_dir: str | Path | None = None,
        hide: Iterable[str | Path] = (),
        allow_weaker: bool = False,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.isolation: Isolation = isolation()
        if self.isolation.missing and not allow_weaker:
            raise SandboxError(self.isolation.refusal())
        self.hide = (PROJECT, *(Path(p) for p in hide))
        self.namespaced = self.isolation.mode == "namespaces"
        self._lease: UidLease | None = None
        if self.isolation.mode in ("namespaces", "uid"):
            locks = _owned_dir(Path(uid_lock_dir or default_uid_lock_dir()), 0o700)
            self._lease = UidLease(locks, uid_base, uid_count)
        self.uid = self._lease.uid if self._lease else None
        self.cgroup: SessionCgroup | None = None
        if self.uid is not None and self.isolation.cgroup.places:
            self.cgroup = SessionCgroup(self.isolation.cgroup, f"u{self.uid}")
        self.holder: Holder | None = None
        self._base = base_dir
        self._folder: Path | None = None  # weaker modes: the session's folder on the host
        self.path = Path(WORKDIR)  # the host's path to the working directory once opened
        home = WORKDIR if self.namespaced else ""
        self.env = {"PATH": PATH, "HOME": home, "TMPDIR": "/tmp" if home else ""}
        self.env |= {"LANG": "C.UTF-8", "TERM": "dumb", "USER": "agent", "SHELL": SHELL}
        self._preexec: Callable[[], None] | None = None
        self.closed = False

    @classmethod
    async def open(cls, **options) -> Sandbox:
        """Build one: its uid, cgroup and namespaces (or, in weaker modes, its folder)."""
        await asyncio.to_thread(isolation)  # the first call probes the host
        box = cls(**options)
        try:
            await box._start()
        except BaseException:
            await box.close()
            raise
        return box

    async def _start(self) -> None:
        join: list[bytes] = []
        if self.cgroup is not None:
            self.cgroup.create(self.limits)
            join = self.cgroup.join_files()
        if self.namespaced:
            assert self.uid is not None
            self.holder = await Holder.start(limits=self.limits, uid=self.uid, hidden=self.hide)
            self.path = Path(self.holder.host_path(WORKDIR))
            watched = self.cgroup is not None and self.cgroup.has("cpuacct")
            self._preexec = enter_preexec(self.limits, join, cpu_backstop=watched)
            return
        if self.uid is not None:
            await kill_uid(self.uid)  # what a crashed worker left running under it
        base = _owned_dir(Path(self._base) if self._base else default_base_dir(), 0o711)
        self.path = self._folder = base / f"s-{secrets.token_hex(8)}"
        self.path.mkdir(mode=0o700)
        if self.uid is not None:
            os.chown(self.path, self.uid, self.uid)
        self.env |= {"HOME": str(self.path), "TMPDIR": str(self.path)}
        iso = self.isolation
        self._preexec = legacy_preexec(iso.mode, iso.network, self.limits, self.uid, join)

    def _cpu_used_ns(self, since: int | None) -> int | None:
        if since is None or self.cgroup is None:
            return None
        now = self.cgroup.usage_ns()
        return None if now is None else now - since

    def _next_cpu_check_s(self, used_ns: int) -> float:
        """Soonest the session could reach its CPU time at full speed on every core it may use."""
        cores = min(self.limits.cpus, os.cpu_count() or 1)
        if self.cgroup is None or not self.cgroup.has("cpu"):
            cores = os.cpu_count() or 1
        left_s = self.limits.cpu_s - used_ns / 1e9
        return max(CPU_CHECK_MIN_S, left_s / cores)

    async def run(self, command: str, args: Sequence[str] = ()) -> CommandResult:
        """Run ``bash -c command`` (``args`` as $1, $2, ...) in the session directory."""
        if self.closed or self._preexec is None:
            raise SandboxError("the sandbox is closed")
        loop, limits, started = asyncio.get_running_loop(), self.limits, time.monotonic()
        argv = [SHELL, "-c", command, "bash", *args]
        if self.holder is not None:
            if not self.holder.alive:
                text = "the command could not start: the session's sandbox is gone"
                return CommandResult(126, text, 0, False, None, 0.0)
            argv = self.holder.enter(argv)
        before = self.cgroup.counters() if self.cgroup else (0, 0)
        full_before = self._full()
        cpu_start = self.cgroup.usage_ns() if self.cgroup else None
        try:
            # Popen, not asyncio's subprocess: its Process.wait reports the exit only once the
            # pipe closes (too late when a background process holds it), and the pid must be
            # in _LEADERS before anything can await (reap_orphans must never take it).
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=None if self.holder else self.path,
                env=self.env,
                start_new_session=True,  # its own process group: killed as one
                preexec_fn=self._preexec,
            )
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            # EAGAIN: the session's uid is at its process limit; E2BIG; a NUL byte (ValueError)
            text = f"the command could not start: {exc}"
            return CommandResult(126, text, 0, False, None, time.monotonic() - started)
        uids._LEADERS.add(proc.pid)
        exited = _exit_future(loop, proc.pid)
        capture = _Capture(loop, limits.output_bytes)
        stopped: str | None = None
        transport = None
        try:
            transport, _ = await loop.connect_read_pipe(lambda: capture, proc.stdout)
            stopped = await self._watch(capture, exited, started, cpu_start)
            if stopped is None:
                # It ended: end what it left in the background, then take what is still in the
                # pipe. A process that left the group (setsid) and holds the pipe is cut off.
                self._kill_group(proc.pid)
                if self.cgroup is not None:
                    await self.cgroup.kill()
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
            if self.cgroup is not None:
                await self.cgroup.kill()  # every process of the session ends with the command
            elif stopped in ("wall", "output") and self.uid is not None:
                await kill_uid(self.uid)  # also what left the group (setsid)
            await asyncio.wait({exited}, timeout=5.0)  # SIGKILLed: only a stuck kernel call waits
            stuck = not exited.done()
            exited.cancel()
            code = await asyncio.to_thread(proc.wait) if stuck else proc.wait()
            uids._LEADERS.discard(proc.pid)
            if proc.stdout:
                proc.stdout.close()
            if self.uid is not None and not self.namespaced:
                uids.reap_orphans()
        return CommandResult(
            exit_code=code,
            output=capture.kept.decode("utf-8", errors="replace"),
            output_bytes=capture.seen,
            truncated=capture.seen > limits.output_bytes,
            stopped=stopped,
            seconds=time.monotonic() - started,
            hit=self._hits(before, full_before),
        )

    async def _watch(
        self,
        capture: _Capture,
        exited: asyncio.Future,
        started: float,
        cpu_start: int | None,
    ) -> str | None:
        """Wait for the command to end; why it was stopped ("output", "wall", "cpu") or None."""
        deadline = started + self.limits.wall_s
        used = self._cpu_used_ns(cpu_start)
        while True:
            timeout = deadline - time.monotonic()
            if used is not None:
                timeout = min(timeout, self._next_cpu_check_s(used))
            done, _ = await asyncio.wait(
                {capture.over, exited}, timeout=max(0.0, timeout), return_when=FIRST_COMPLETED
            )
            if capture.over in done:
                return "output"
            if done:
                return None
            if time.monotonic() >= deadline:
                return "wall"
            used = self._cpu_used_ns(cpu_start)
            if used is not None and used >= self.limits.cpu_s * 1_000_000_000:
                return "cpu"

    def _full(self) -> set[str]:
        """The session's tmpfs folders with no room left (FULL's names)."""
        full = set()
        for name, inside in FULL if self.holder is not None else ():
            try:
                st = os.statvfs(self.holder.host_path(inside))  # type: ignore[union-attr]
            except OSError:
                continue
            if st.f_bavail <= 1:
                full.add(name)
        return full

    def _hits(self, before: tuple[int, int], full_before: set[str]) -> tuple[str, ...]:
        """The session limits the command ran into: the cgroup's counters moved, or a tmpfs
        folder it filled (one already full before it is not news)."""
        hit: list[str] = []
        if self.cgroup is not None:
            oom, forks = self.cgroup.counters()
            if oom > before[0]:
                hit.append("memory")
            if forks > before[1]:
                hit.append("nproc")
        full = self._full() - full_before
        hit += [name for name, _ in FULL if name in full]
        return tuple(hit)

    @staticmethod
    def _kill_group(pgid: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, signal.SIGKILL)

    async def kill_all(self) -> None:
        """Kill every process the session left running (where the session's processes can be
        told apart: its cgroup, or its uid; elsewhere each command's group is already gone)."""
        if self.cgroup is not None:
            await self.cgroup.kill()
        elif self.uid is not None:
            await kill_uid(self.uid)

    async def close(self) -> None:
        """End the session's processes and namespaces (their tmpfs with them), or remove its
        folder; remove its cgroup; free its uid."""
        if self.closed:
            return
        self.closed = True
        try:
            await self.kill_all()
            if self.holder is not None:
                await self.holder.stop()
            elif self._folder is not None:
                try:
                    await asyncio.to_thread(_remove_tree, self._folder)
                except FileNotFoundError:
                    pass
                except OSError as exc:
                    log.warning(
                        "a sandbox directory could not be removed",
                        path=str(self._folder),
                        error=str(exc),
                    )
            if self.cgroup is not None:
                await self.cgroup.remove()
        finally:
            if self._lease:
                self._lease.release()
