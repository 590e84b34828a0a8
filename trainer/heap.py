"""Returning the trainer's freed memory to the system (glibc only; elsewhere nothing is done).

A step allocates and frees tens of gigabytes of activations and gradients, each tensor a
separate ``malloc``. glibc serves a large request with its own ``mmap`` (returned to the system
by ``free``) only above its mmap threshold, and raises that threshold to the size of every
mapped block freed, up to 32 MiB: after the first pass, a pass's activations (a 4,096-token
pass on SmolLM2: 9-25 MB each) come from the heap, and what the heap frees mostly stays with
the process. The calculator recipe's trainer held 14-15 GB between steps that way, against the
1.1 GB its tensors take (docs/benchmarks.md, "Trainer memory held by the allocator").

``--heap release`` (the default): ``release()`` after each pass's backward and after each
optimizer step, ``malloc_trim(0)``, which hands the free pages inside every arena back to the
system. It costs no measurable step time and leaves about what the tensors hold between steps;
within a pass the heap still grows past what the pass needs (a peak of 12 GB where 7 GB are
live). Fixing the mmap threshold from inside the process (glibc's ``mallopt``, 8 MiB) brought
the peak down too, but its steps took 51-57 s against glibc's 43-47 s (page faults); set in the process's environment
before it starts, with glibc asked for transparent huge pages
(``MALLOC_MMAP_THRESHOLD_=1048576 GLIBC_TUNABLES=glibc.malloc.hugetlb=1``:
``TRAINER_MALLOC_ENV``), the same threshold cost nothing measurable on that large step and
halved its peak. It is opt-in: the tiny model's demo, whose trainer takes many small steps
beside the engine and the consumers, ran 1.7 times slower with it (457 s against 262 s).
``--heap default`` leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

HEAP_MODES = ("release", "default")
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


def release() -> bool:
    """Hand the heap's free pages back to the system; False where nothing was released."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))
