"""A cgroup per session: the memory, processes and CPU of all its processes together.

Session cgroups live under the worker's own cgroup, in ``agentarium-shell/u<uid>`` (named by
the session's uid, whose lease is exclusive on the machine, so a crashed worker's cgroup is
found again by the next lease or the sweep at start, ``sweep``). Every command joins the
session's cgroup before it runs (its ``cgroup.procs``, written in the child before ``exec``),
so everything it starts is counted there.

Both layouts:

- **v1** (one hierarchy per controller, as on this project's test machine): a session cgroup
  in each of ``memory`` (``memory.limit_in_bytes``, and ``memsw`` so swap cannot stretch it),
  ``pids`` (``pids.max``), ``cpu`` (``cpu.cfs_quota_us``: the cores it may use at once) and
  ``cpuacct`` (``cpuacct.usage``: the CPU time, which the worker watches per command).
- **v2** (one tree, most machines now): one session cgroup with ``memory.max``,
  ``memory.swap.max`` 0, ``memory.oom.group`` (an OOM kill ends the whole session's processes),
  ``pids.max``, ``cpu.max``, and ``cpu.stat`` for the usage. The controllers must be enabled in
  the parents' ``cgroup.subtree_control``, which the kernel refuses while the worker's own cgroup
  holds processes ("no internal processes"): the worker then moves itself into a leaf,
  ``agentarium-worker``, if it is the only process there, and otherwise says what to do (give the
  worker a cgroup of its own: systemd's ``Delegate=yes``, or Docker's ``--cgroupns=private``).

What fired is read from the kernel's own counters: ``oom_kill`` (v1 ``memory.oom_control``, v2
``memory.events``) and the ``max`` line of ``pids.events`` (forks refused at ``pids.max``).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path

from .limits import SandboxLimits

#: memory, pids, cpu (the rate cap), cpuacct (the usage: v1's cpuacct, v2's cpu.stat)
ROLES = ("memory", "pids", "cpu", "cpuacct")
PARENT = "agentarium-shell"
WORKER_LEAF = "agentarium-worker"
CFS_PERIOD_US = 100_000


@dataclass(frozen=True)
class Place:
    version: str  # "v1" or "v2"
    parent: Path  # where this role's session cgroups are made


@dataclass(frozen=True)
class CgroupLayout:
    """Where each role's session cgroups go, and why a role is missing."""

    places: dict[str, Place] = field(default_factory=dict)
    problems: dict[str, str] = field(default_factory=dict)

    @property
    def version(self) -> str:
        versions = sorted({p.version for p in self.places.values()})
        return "+".join(versions)

    def parents(self) -> list[Path]:
        return sorted({p.parent for p in self.places.values()})


def _mountinfo() -> tuple[dict[str, tuple[Path, str]], tuple[Path, str] | None]:
    """v1 mounts by controller, and the v2 mount: (mount point, the cgroup path it shows)."""
    v1: dict[str, tuple[Path, str]] = {}
    v2 = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            root, point, fstype = fields[3], Path(fields[4]), tail[0]
            if fstype == "cgroup2" and v2 is None:
                v2 = (point, root)
            elif fstype == "cgroup":
                for option in tail[2].split(","):
                    if option in ROLES and option not in v1:
                        v1[option] = (point, root)
    return v1, v2


def _own_paths() -> dict[str, str]:
    """This process's cgroup path per v1 controller, and under "" its v2 path."""
    out: dict[str, str] = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for name in controllers.split(",") if controllers else [""]:
                out[name] = path
    return out


def _under(mount: tuple[Path, str], own: str) -> Path:
    point, root = mount
    relative = os.path.relpath(own, root) if own.startswith(root) else "."
    return (point / relative).resolve()


def _write(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def find_layout() -> CgroupLayout:
    """Find (and make) the parents of session cgroups; probe that each role works there."""
    if os.geteuid() != 0:
        why = "the worker is not root"
        return CgroupLayout(problems=dict.fromkeys(ROLES, why))
    try:
        v1, v2 = _mountinfo()
        own = _own_paths()
    except OSError as exc:
        return CgroupLayout(problems=dict.fromkeys(ROLES, f"cannot read /proc: {exc}"))
    places: dict[str, Place] = {}
    problems: dict[str, str] = {}
    for role in ROLES:
        if role in v1 and role in own:
            parent = _under(v1[role], own[role]) / PARENT
            try:
                parent.mkdir(exist_ok=True)
                places[role] = Place("v1", parent)
            except OSError as exc:
                problems[role] = f"cannot make {parent}: {exc.strerror}"
    wanted = [r for r in ROLES if r not in places and r not in problems]
    if wanted and v2 is not None and "" in own:
        placed, why = _v2_parent(_under(v2, own[""]), wanted)
        for role in wanted:
            if role in placed:
                places[role] = Place("v2", placed[role])
            else:
                problems[role] = why or "not available in the cgroup v2 tree"
    for role in ROLES:
        if role not in places and role not in problems:
            problems[role] = "no cgroup controller mounted"
    layout = CgroupLayout(places, problems)
    return _probe(layout)


def _v2_parent(base: Path, roles: list[str]) -> tuple[dict[str, Path], str]:
    """The v2 parent for ``roles`` (controllers enabled down to it), or why not."""
    try:
        available = set((base / "cgroup.controllers").read_text().split())
    except OSError as exc:
        return {}, f"cannot read {base}/cgroup.controllers: {exc.strerror}"
    controllers = [r for r in ("memory", "pids", "cpu") if r in roles and r in available]
    parent = base / PARENT
    enable = " ".join(f"+{c}" for c in controllers)
    try:
        if controllers:
            try:
                _write(base / "cgroup.subtree_control", enable)
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                _leave_for_leaf(base)
                _write(base / "cgroup.subtree_control", enable)
        parent.mkdir(exist_ok=True)
        if controllers:
            _write(parent / "cgroup.subtree_control", enable)
    except OSError as exc:
        return {}, f"cannot enable {enable or 'cgroups'} under {base}: {exc.strerror}"
    placed: dict[str, Path] = {r: parent for r in controllers}
    if "cpuacct" in roles:  # cpu.stat is in every v2 cgroup
        placed["cpuacct"] = parent
    missing = [r for r in ("memory", "pids", "cpu") if r in roles and r not in available]
    return placed, (f"not delegated to {base}" if missing else "")


def _leave_for_leaf(base: Path) -> None:
    """v2 allows controllers for children only in a cgroup without processes: move this
    worker into a leaf of its own cgroup, if it is the only process there."""
    procs = (base / "cgroup.procs").read_text().split()
    if procs != [str(os.getpid())]:
        raise OSError(
            errno.EBUSY,
            f"other processes share the worker's cgroup {base}: give the worker a cgroup of its "
            "own (systemd Delegate=yes, docker --cgroupns=private)",
        )
    leaf = base / WORKER_LEAF
    leaf.mkdir(exist_ok=True)
    _write(leaf / "cgroup.procs", str(os.getpid()))


def _probe(layout: CgroupLayout) -> CgroupLayout:
    """Make a cgroup with small limits in each place, read its counters, remove it."""
    name = f"probe-{os.getpid()}"
    places, problems = dict(layout.places), dict(layout.problems)
    for role, place in layout.places.items():
        probe = SessionCgroup(CgroupLayout({role: place}), name)
        try:
            probe.create(SandboxLimits())
            probe.counters()
            probe.usage_ns()
        except OSError as exc:
            del places[role]
            problems[role] = f"cannot use {place.parent}: {exc.strerror or exc}"
        finally:
            probe.remove_now()
    return CgroupLayout(places, problems)


def _read_key(path: Path, key: str) -> int:
    with open(path) as f:
        for line in f:
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0


class SessionCgroup:
    """One session's cgroup (one directory per v1 hierarchy, one in v2)."""

    def __init__(self, layout: CgroupLayout, name: str) -> None:
        self.name = name
        self.roles = {
            role: (place.version, place.parent / name) for role, place in layout.places.items()
        }
        self.dirs = sorted({d for _, d in self.roles.values()})

    def has(self, role: str) -> bool:
        return role in self.roles

    def create(self, limits: SandboxLimits) -> None:
        """Make it (after ending what a crashed worker left under this name) and set limits."""
        if any(d.exists() for d in self.dirs):
            self.kill_now()
            self.remove_now()
        for d in self.dirs:
            d.mkdir()
        if "memory" in self.roles:
            version, d = self.roles["memory"]
            size = str(limits.session_memory_bytes)
            if version == "v1":
                _write(d / "memory.limit_in_bytes", size)
                if (d / "memory.memsw.limit_in_bytes").exists():
                    _write(d / "memory.memsw.limit_in_bytes", size)
            else:
                _write(d / "memory.max", size)
                if (d / "memory.swap.max").exists():
                    _write(d / "memory.swap.max", "0")
                _write(d / "memory.oom.group", "1")
        if "pids" in self.roles:
            _write(self.roles["pids"][1] / "pids.max", str(limits.nproc))
        if "cpu" in self.roles:
            version, d = self.roles["cpu"]
            quota = max(1000, int(limits.cpus * CFS_PERIOD_US))
            if version == "v1":
                _write(d / "cpu.cfs_period_us", str(CFS_PERIOD_US))
                _write(d / "cpu.cfs_quota_us", str(quota))
            else:
                _write(d / "cpu.max", f"{quota} {CFS_PERIOD_US}")

    def join_files(self) -> list[bytes]:
        """The ``cgroup.procs`` files a command's child writes "0" (itself) to, before exec."""
        return [str(d / "cgroup.procs").encode() for d in self.dirs]

    def counters(self) -> tuple[int, int]:
        """(processes the OOM killer ended, forks refused at pids.max), since creation."""
        oom = fork = 0
        if "memory" in self.roles:
            version, d = self.roles["memory"]
            events = d / ("memory.oom_control" if version == "v1" else "memory.events")
            oom = _read_key(events, "oom_kill")
        if "pids" in self.roles:
            fork = _read_key(self.roles["pids"][1] / "pids.events", "max")
        return oom, fork

    def usage_ns(self) -> int | None:
        """CPU time of every process that ran in it, nanoseconds; None without accounting."""
        if "cpuacct" not in self.roles:
            return None
        version, d = self.roles["cpuacct"]
        if version == "v1":
            return int((d / "cpuacct.usage").read_text())
        return _read_key(d / "cpu.stat", "usage_usec") * 1000

    def procs(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            with contextlib.suppress(FileNotFoundError):
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
        return sorted(found)

    def _kill_round(self) -> bool:
        """SIGKILL what is in it; whether anything was."""
        pids = self.procs()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return bool(pids)

    def _start_kill(self) -> None:
        for version, d in self.roles.values():
            if version == "v2" and (d / "cgroup.kill").exists():
                with contextlib.suppress(OSError):
                    _write(d / "cgroup.kill", "1")  # atomic, forks included (Linux >= 5.14)
                return

    async def kill(self, *, within_s: float = 5.0) -> None:
        """End every process in it; returns once none is left (or ``within_s`` passed)."""
        self._start_kill()
        deadline = time.monotonic() + within_s
        while self._kill_round() and time.monotonic() < deadline:
            await asyncio.sleep(0.002)  # SIGKILLed: they leave the cgroup as the kernel ends them

    def kill_now(self, *, within_s: float = 5.0) -> None:
        """``kill`` for the sweep and the probe, outside the event loop."""
        self._start_kill()
        deadline = time.monotonic() + within_s
        while self._kill_round() and time.monotonic() < deadline:
            time.sleep(0.002)

    def _rmdir_all(self) -> bool:
        busy = False
        for d in self.dirs:
            try:
                d.rmdir()
            except FileNotFoundError:
                pass
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                busy = True
        return busy

    async def remove(self, *, within_s: float = 5.0) -> None:
        """Remove it once its processes are gone (the kernel ends a dying namespace's last
        processes just after its init)."""
        deadline = time.monotonic() + within_s
        while self._rmdir_all() and time.monotonic() < deadline:
            self._kill_round()
            await asyncio.sleep(0.002)

    def remove_now(self, *, within_s: float = 5.0) -> None:
        deadline = time.monotonic() + within_s
        while self._rmdir_all() and time.monotonic() < deadline:
            self._kill_round()
            time.sleep(0.002)


def sweep(layout: CgroupLayout, hold: Callable[[int], AbstractContextManager[bool]]) -> int:
    """At worker start: end and remove the session cgroups (``u<uid>``) whose uid no live
    worker holds (``hold(uid)`` holds its lease while they go, if it is free), and leftover
    probes; how many were removed."""
    removed = 0
    for parent in layout.parents():
        with contextlib.suppress(FileNotFoundError):
            for child in parent.iterdir():
                name = child.name
                if not child.is_dir():
                    continue
                if name.startswith("probe-") and not _alive(name[6:]):
                    removed += _remove(layout, name)
                elif name.startswith("u") and name[1:].isdigit():
                    with hold(int(name[1:])) as free:
                        if free:
                            removed += _remove(layout, name)
    return removed


def _remove(layout: CgroupLayout, name: str) -> int:
    cg = SessionCgroup(layout, name)
    cg.kill_now()
    cg.remove_now()
    return 1


def _alive(pid: str) -> bool:
    return pid.isdigit() and os.path.exists(f"/proc/{pid}")
