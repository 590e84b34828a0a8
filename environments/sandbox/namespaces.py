"""A session's namespaces: one ``bwrap`` process holds them, every command enters them.

A session (mode ``namespaces``, the worker root) gets its own mount, PID, IPC, UTS and network
namespaces, made by bubblewrap (``bwrap``) when the session opens and kept by a holder process
(``sleep``) until it closes. Its root file system: the host's system folders read-only
(``SYSTEM``, ``/etc`` with its secrets masked, ``MASKED``), a fresh ``/proc`` of the session's
PID namespace, a minimal ``/dev``, and three size-capped tmpfs: the working directory
(``WORKDIR``, the session uid's), ``/tmp`` and ``/dev/shm``. Nothing else of the host: no
``/home``, ``/root``, ``/work``, ``/srv``, ``/opt``, ``/var``, ``/run`` (its sockets), no project
tree, no worker file. Paths that would still show through a system folder (the agentarium
package installed under ``/usr``, a task file) are masked too (``hidden``).

Each command enters with ``nsenter`` (util-linux): the session's namespaces, its root and working
directory, its uid and gid. ``nsenter`` forks once more to enter the PID namespace and passes
the command's exit status (or signal) back. When the holder dies, the kernel kills every process
of the namespace and frees its tmpfs; bwrap's ``--die-with-parent`` makes that happen when the
worker dies, however it dies.

Why bubblewrap rather than our own ``unshare``/``mount`` code: a root file system is many
mounts done in an order that matters (bind, then remount read-only with nosuid and nodev; proc
only from inside the PID namespace, which needs a process of its own there; pivot_root), plus an
init that reaps orphans; bwrap does exactly this, in C, audited as Flatpak's sandbox, and costs
a few milliseconds per session. Written in Python it would be a second process per session (the
PID namespace's init) with the interpreter's start-up and memory, and code of ours to trust.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path

from .limits import SandboxError, SandboxLimits

BWRAP = "bwrap"
NSENTER = "nsenter"
WORKDIR = "/home/agent"
PATH = "/usr/local/bin:/usr/bin:/bin"
#: the host's system folders, read-only (a symlink, as merged-/usr makes /bin, stays one)
SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")
#: never shown, though the session uid could not read most of them anyway
MASKED = (
    "/etc/shadow",
    "/etc/shadow-",
    "/etc/gshadow",
    "/etc/gshadow-",
    "/etc/sudoers",
    "/etc/sudoers.d",
    "/etc/ssh",
    "/etc/ssl/private",
    "/etc/security/opasswd",
    "/etc/agentarium",
)
# The holder: says it is ready once the root is built, then holds the namespaces.
HOLD = "echo; exec sleep infinity >/dev/null 2>&1"
READY_TIMEOUT_S = 30.0


def available() -> str:
    """ "" if bwrap and nsenter are on PATH, else what to install."""
    if shutil.which(BWRAP) is None:
        return "bubblewrap is not installed (apt-get install bubblewrap)"
    if shutil.which(NSENTER) is None:
        return "nsenter is not installed (apt-get install util-linux)"
    return ""


def _visible(path: Path) -> bool:
    """Whether ``path`` shows through one of the system folders."""
    real = path.resolve()
    for top in SYSTEM:
        root = Path(top).resolve()
        if real == root or root in real.parents:
            return True
    return False


def _mask(path: Path) -> list[str]:
    if path.is_dir():
        return ["--tmpfs", str(path), "--remount-ro", str(path)]
    return ["--ro-bind", "/dev/null", str(path)]


def bwrap_args(
    limits: SandboxLimits, hidden: Iterable[Path], data_fds: dict[str, int]
) -> list[str]:
    """bwrap's options for a session (the holder command follows them)."""
    args = [
        "--unshare-ipc",
        "--unshare-pid",
        "--unshare-net",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--die-with-parent",
        "--new-session",
        "--hostname",
        "sandbox",
        "--clearenv",
        "--setenv",
        "PATH",
        PATH,
    ]
    for top in SYSTEM:
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for name in MASKED:
        if os.path.lexists(name):
            args += _mask(Path(name))
    for path in sorted({Path(p).resolve() for p in hidden}):
        if path.exists() and _visible(path):
            args += _mask(path)
    for name, fd in sorted(data_fds.items()):
        args += ["--perms", "0644", "--ro-bind-data", str(fd), name]
    tmp, disk = str(limits.tmp_bytes), str(limits.disk_bytes)
    args += ["--proc", "/proc", "--dev", "/dev"]
    args += ["--perms", "1777", "--size", tmp, "--tmpfs", "/tmp"]
    args += ["--perms", "1777", "--size", tmp, "--tmpfs", "/dev/shm"]
    args += ["--dir", "/var", "--symlink", "../tmp", "/var/tmp"]
    args += ["--perms", "0755", "--dir", "/home"]
    args += ["--perms", "0700", "--size", disk, "--tmpfs", WORKDIR, "--chdir", WORKDIR]
    return args


def _accounts(uid: int) -> dict[str, bytes]:
    """/etc/passwd and /etc/group with the session's user, ``agent``, added."""
    out = {}
    for name, line in (
        ("/etc/passwd", f"agent:x:{uid}:{uid}:sandbox:{WORKDIR}:/bin/bash\n"),
        ("/etc/group", f"agent:x:{uid}:\n"),
    ):
        try:
            text = Path(name).read_bytes()
        except OSError:
            text = b""
        if text and not text.endswith(b"\n"):
            text += b"\n"
        out[name] = text + line.encode()
    return out


def _memfd(name: str, data: bytes) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)  # pass_fds lets bwrap inherit it
    os.write(fd, data)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


async def _read(fd: int, *, line: bool = False) -> bytes:
    """What the pipe ``fd`` gives until its end (or its first line); the pipe is closed."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), os.fdopen(fd, "rb", 0)
    )
    try:
        return await (reader.readline() if line else reader.read())
    finally:
        transport.close()


class Holder:
    """The bwrap process that holds one session's namespaces."""

    def __init__(self, proc: subprocess.Popen, info: dict, uid: int) -> None:
        self.proc = proc
        self.pid1 = int(info["child-pid"])  # the namespace's init, as the host numbers it
        self.uid = uid
        # A pidfd, so the init is signalled and watched, never a process that reused its pid;
        # opened while bwrap (its parent, our child) still holds it, and checked to be in the
        # mount namespace bwrap reported.
        self._pidfd = os.pidfd_open(self.pid1)
        mnt = os.readlink(f"/proc/{self.pid1}/ns/mnt")
        if mnt != f"mnt:[{info['mnt-namespace']}]":
            os.close(self._pidfd)
            raise SandboxError(f"the sandbox's init {self.pid1} is not bwrap's ({mnt})")

    @classmethod
    async def start(cls, *, limits: SandboxLimits, uid: int, hidden: Iterable[Path]) -> Holder:
        fds = {name: _memfd("passwd", data) for name, data in _accounts(uid).items()}
        args = bwrap_args(limits, hidden, fds)
        args_fd = _memfd("bwrap-args", b"".join(a.encode() + b"\0" for a in args))
        err_fd = _memfd("bwrap-stderr", b"")
        info_r, info_w = os.pipe()
        ready_r, ready_w = os.pipe()
        passed = (args_fd, info_w, *fds.values())
        try:
            proc = subprocess.Popen(
                [
                    BWRAP,
                    "--args",
                    str(args_fd),
                    "--info-fd",
                    str(info_w),
                    "--",
                    "/bin/sh",
                    "-c",
                    HOLD,
                ],
                pass_fds=passed,
                stdin=subprocess.DEVNULL,
                stdout=ready_w,
                stderr=err_fd,
                env={"PATH": PATH},
            )
        except OSError as exc:
            for fd in (*passed, err_fd, info_r, ready_r, ready_w):
                os.close(fd)
            raise SandboxError(f"bwrap could not start: {exc}") from exc
        for fd in (*passed, ready_w):
            os.close(fd)
        try:
            info_raw, ready = await asyncio.wait_for(
                asyncio.gather(_read(info_r), _read(ready_r, line=True)), READY_TIMEOUT_S
            )
            if ready != b"\n":
                proc.kill()
                await asyncio.to_thread(proc.wait)
                os.lseek(err_fd, 0, os.SEEK_SET)
                text = os.read(err_fd, 4096).decode(errors="replace").strip()
                raise SandboxError(f"bwrap failed: {text or f'exit status {proc.returncode}'}")
            holder = cls(proc, json.loads(info_raw), uid)
            os.chown(holder.host_path(WORKDIR), uid, uid)
        except BaseException:
            if proc.poll() is None:
                proc.kill()
                await asyncio.to_thread(proc.wait)
            raise
        finally:
            os.close(err_fd)
        return holder

    def host_path(self, inside: str) -> str:
        """A path of the session's file system as the worker reaches it (root only)."""
        return f"/proc/{self.pid1}/root{inside}"

    @property
    def alive(self) -> bool:
        """The namespace's init still runs (its pidfd is readable once it has exited)."""
        if self._pidfd < 0 or self.proc.poll() is not None:
            return False
        return not select.select([self._pidfd], [], [], 0)[0]

    def enter(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the session: its namespaces, root, working directory and uid."""
        return [
            NSENTER,
            f"--target={self.pid1}",
            "--mount",
            "--uts",
            "--ipc",
            "--net",
            "--pid",
            "--root",
            "--wd",
            f"--setuid={self.uid}",
            f"--setgid={self.uid}",
            "--",
            *argv,
        ]

    async def stop(self) -> None:
        """End the namespace: its init's death kills every process in it and frees its tmpfs."""
        if self._pidfd >= 0:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            os.close(self._pidfd)
            self._pidfd = -1
        if self.proc.poll() is None:
            try:
                await asyncio.wait_for(asyncio.to_thread(self.proc.wait), 5.0)
            except TimeoutError:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)
