"""The trainer's memory allocator: jemalloc under ``--memory small``, and freed memory handed
back to the system after each pass and step.

A step allocates and frees tens of gigabytes of activations and gradients, each tensor a
separate ``malloc``. glibc serves a large request with its own ``mmap`` (returned to the system
by ``free``) only above its mmap threshold, and raises that threshold to the size of every
mapped block freed, up to 32 MiB: after the first pass, a pass's activations (a 4,096-token
pass on SmolLM2: 9-25 MB each) come from the heap, and what the heap frees mostly stays with
the process. The calculator recipe's trainer held 14-15 GB between steps that way, against the
1.1 GB its tensors take (docs/benchmarks.md, "Trainer memory held by the allocator").

``--heap release`` (the default): ``release()`` after each pass's backward and after each
optimizer step. On glibc, ``malloc_trim(0)``, which hands the free pages inside every arena back
to the system; it costs no measurable step time, but within a pass glibc's heap still grows past
what the pass needs (a peak of 12 GB where 7 GB are live; SmolLM2's first step under
``--memory small``: 2,099-2,234 MiB where jemalloc needs 1,875).

``--allocator jemalloc`` (``auto`` picks it under ``--memory small`` where Debian's libjemalloc2
is installed): the trainer process preloads jemalloc by executing itself again at its start
(``use_allocator``; a preload must be in place before the process starts), with
``JEMALLOC_CONF``: freed pages are kept for reuse and never purged by time, every size is served
from the ordinary arenas, no transparent huge pages are asked for, and ``release()`` purges every
arena (``mallctl("arena.4096.purge")``). Its size classes reuse a pass's freed tensors where
glibc's heap fragments: SmolLM2's first step peaks at 1,871-1,880 MiB in 51-54 s (glibc:
2,099-2,234 MiB in 53-55 s; docs/benchmarks.md, "The defaults"). jemalloc's own defaults were
slower: a request over 8 MiB gets an arena that unmaps it when freed, and dirty pages are
purged after 10 s, so a pass faults its pages in again (60-63 s a step).

Fixing glibc's mmap threshold from inside the process (``mallopt``, 8 MiB) brought the peak
down too, but its steps took 51-57 s against glibc's 43-47 s (page faults); set in the
process's environment before it starts, with glibc asked for transparent huge pages
(``MALLOC_MMAP_THRESHOLD_=1048576 GLIBC_TUNABLES=glibc.malloc.hugetlb=1``:
``TRAINER_MALLOC_ENV``), the same threshold cost nothing measurable on a large LoRA step and
halved its peak, but made the tiny model's demo 1.7 times slower (457 s against 262 s), and
SmolLM2's full step 1.5 times. ``--heap default`` leaves the allocator as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import sys

HEAP_MODES = ("release", "default")
ALLOCATORS = ("auto", "jemalloc", "glibc")
_JEMALLOC = "libjemalloc.so.2"  # Debian's libjemalloc2 (ops/setup.sh installs it)
_EXECED = "AGENTARIUM_ALLOCATOR_EXEC"  # set across the one re-exec: never a second
# jemalloc's settings for the trainer (``MALLOC_CONF``, unless the environment sets its own):
# freed pages kept for reuse, never purged by time (``release`` purges them after each pass
# and step), every size in the ordinary arenas (jemalloc's default gives requests over 8 MiB
# an arena that unmaps them at once: a fault per page every pass). No transparent huge pages:
# with "thp:always" a step's RSS held 180-340 MiB more than jemalloc's pages (SmolLM2's second
# step with an 8,192-token row: 2,241 MiB against 2,020-2,036 without, at the same step time on
# the 16-row batch: docs/benchmarks.md, "A long pass's layers sliced")
JEMALLOC_CONF = "oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1"
# glibc's settings for a trainer process's environment (read at its start: the module docstring)
TRAINER_MALLOC_ENV = {
    "MALLOC_MMAP_THRESHOLD_": "1048576",
    "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1",
}


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (``malloc_trim`` is its own)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def _mallctl():  # type: ignore[no-untyped-def]
    """jemalloc's ``mallctl``, when this process runs on jemalloc; else None."""
    if running_allocator() != "jemalloc":
        return None
    try:
        return ctypes.CDLL(None).mallctl
    except AttributeError:
        return None


def release() -> bool:
    """Hand the heap's free pages back to the system; False where nothing was released. On
    jemalloc: purge every arena's unused pages (``arena.<all>.purge``)."""
    mallctl = _mallctl()
    if mallctl is not None:
        return mallctl(b"arena.4096.purge", None, None, None, 0) == 0
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))


def find_jemalloc() -> str | None:
    """jemalloc's shared library, as ``LD_PRELOAD`` takes it; None where it is not installed."""
    if not sys.platform.startswith("linux"):
        return None
    # not dlopen: jemalloc cannot be loaded after a process starts (its static TLS)
    return _JEMALLOC if ctypes.util.find_library("jemalloc") == _JEMALLOC else None


def running_allocator() -> str:
    """The malloc this process runs on: ``jemalloc`` when its library is mapped, else ``glibc``
    (or the platform's own)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return "jemalloc" if any("libjemalloc" in line for line in maps) else "glibc"
    except OSError:
        return "glibc"


def wanted_allocator(name: str) -> str:
    """``jemalloc`` or ``glibc``: ``auto`` is jemalloc where it is installed. A named jemalloc
    that is missing raises ValueError, saying how to install it."""
    if name == "glibc":
        return "glibc"
    if find_jemalloc() is None:
        if name == "jemalloc":
            raise ValueError(
                "--allocator jemalloc: libjemalloc.so.2 is not installed (apt-get install "
                "libjemalloc2), or pass --allocator glibc"
            )
        return "glibc"
    return "jemalloc"


def allocator_env(name: str) -> dict[str, str]:
    """The environment a process must start with to run on allocator ``name`` (``auto``,
    ``jemalloc`` or ``glibc``): jemalloc preloaded, or nothing."""
    if wanted_allocator(name) != "jemalloc":
        return {}
    env = {} if os.environ.get("MALLOC_CONF") else {"MALLOC_CONF": JEMALLOC_CONF}
    preload = os.environ.get("LD_PRELOAD", "")
    if _JEMALLOC not in preload.replace(":", " ").split():
        env["LD_PRELOAD"] = f"{_JEMALLOC} {preload}".strip()
    return env


def use_allocator(name: str) -> None:
    """Run this process on allocator ``name``: when it asks for jemalloc and runs on another,
    re-execute it (the same pid, arguments and environment, jemalloc preloaded), once. Call it
    before anything else starts (threads, sockets, child processes)."""
    if wanted_allocator(name) != "jemalloc" or running_allocator() == "jemalloc":
        return
    if os.environ.get(_EXECED):  # preloaded and still not mapped: say so, never loop
        raise ValueError(f"{_JEMALLOC} was preloaded but is not in use: pass --allocator glibc")
    env = {**os.environ, **allocator_env(name), _EXECED: "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)
