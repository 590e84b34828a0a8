"""What a sandboxed command may use, and what became of it: ``SandboxLimits``, ``CommandResult``.

Two kinds of limit. Per process (rlimits, on every host): address space, file size, open files,
and CPU seconds as a backstop. Per session (a cgroup and capped file systems, where the host
gives them, ``host.py``): the memory, processes and CPU time of all the session's processes
together, and the size of its working directory, ``/tmp`` and ``/dev/shm``.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

KIB, MIB, GIB = 1024, 1024**2, 1024**3


class SandboxError(RuntimeError):
    """The sandbox could not be set up (no free uid, an unsafe base directory, a host that
    lacks the isolation asked for); the message says what to do."""


def human_bytes(n: int) -> str:
    """``1 GiB``, ``64 MiB``, ``1.5 GiB``, ``100 KiB``, ``12 bytes``."""
    for unit, size in (("GiB", GIB), ("MiB", MIB), ("KiB", KIB)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} bytes"


@dataclass(frozen=True, kw_only=True)
class SandboxLimits:
    """Per command: ``cpu_s`` (CPU seconds of the session's processes together; per process
    where the host has no cgroup), ``wall_s``, ``output_bytes`` (kept, then the command is
    stopped). Per process: ``memory_bytes`` (address space), ``file_size_bytes``, ``nofile``.
    Per session: ``nproc`` (processes at once), ``session_memory_bytes`` (its processes and
    the files in its tmpfs folders together), ``cpus`` (cores at once), ``disk_bytes`` (the
    working directory), ``tmp_bytes`` (``/tmp`` and ``/dev/shm``, each)."""

    cpu_s: int = 10
    wall_s: float = 30.0
    memory_bytes: int = 512 * MIB
    file_size_bytes: int = 64 * MIB
    output_bytes: int = 64 * KIB
    nproc: int = 64
    nofile: int = 256
    session_memory_bytes: int = GIB
    cpus: float = 1.0
    disk_bytes: int = 256 * MIB
    tmp_bytes: int = 64 * MIB

    def __post_init__(self) -> None:
        for name in (
            "cpu_s",
            "wall_s",
            "memory_bytes",
            "file_size_bytes",
            "output_bytes",
            "cpus",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"SandboxLimits.{name} must be > 0")
        if self.nproc < 2 or self.nofile < 16:
            raise ValueError("SandboxLimits: nproc must be >= 2 and nofile >= 16")
        for name in ("session_memory_bytes", "disk_bytes", "tmp_bytes"):
            if getattr(self, name) < MIB:
                raise ValueError(f"SandboxLimits.{name} must be at least 1 MiB")

    def rlimits(self, *, nproc: bool, cpu_backstop: bool) -> list[tuple[int, tuple[int, int]]]:
        """The per-process limits. ``cpu_backstop``: the session's CPU time is watched as a
        whole, so a process's own limit sits two seconds above it and only fires if the watch
        is late. Otherwise SIGXCPU at ``cpu_s``, SIGKILL one second later if it is ignored."""
        cpu = self.cpu_s + 2 if cpu_backstop else self.cpu_s
        out = [
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),
            (resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes)),
            (resource.RLIMIT_FSIZE, (self.file_size_bytes, self.file_size_bytes)),
            (resource.RLIMIT_NOFILE, (self.nofile, self.nofile)),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if nproc:
            out.append((resource.RLIMIT_NPROC, (self.nproc, self.nproc)))
        return out


#: Session limits a command can run into, as ``CommandResult.hit`` names them.
HITS = ("memory", "nproc", "disk", "tmp", "shm")


@dataclass(frozen=True)
class CommandResult:
    """One command's outcome. ``stopped`` says why the worker killed it: "wall", "output",
    "cpu" (the session's CPU time for the command), or "background" (the command ended but a
    process that left its group kept the output open). ``hit``: the session limits it ran
    into (``HITS``), whatever else happened."""

    exit_code: int  # negative: killed by that signal
    output: str  # stdout and stderr interleaved, at most output_bytes of it
    output_bytes: int  # how much the command wrote before it ended or was stopped
    truncated: bool
    stopped: str | None
    seconds: float
    hit: tuple[str, ...] = ()
