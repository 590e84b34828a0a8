"""Returning the trainer's freed memory to the system (glibc only; elsewhere nothing is done).

A step allocates and frees tens of gigabytes of activations and gradients, each tensor a
separate ``malloc``. glibc serves a large request with its own ``mmap`` (returned to the system
by ``free``) only above its mmap threshold, and raises that threshold to the size of every
mapped block freed, up to 32 MiB: after the first pass, a pass's activations (a 4,096-token
pass on SmolLM2: 9-25 MB each) come from the heap, and what the heap frees mostly stays with
the process. The calculator recipe's trainer held 15 GB between steps that way, against the
1.8 GB its tensors took (docs/benchmarks.md, "Trainer memory held by the allocator").

``release_heap`` (``--heap release``, the default):

- ``configure()``, once per process: the mmap threshold fixed at ``MMAP_THRESHOLD`` (8 MiB),
  so it no longer rises and the largest tensors are mapped and unmapped as they come and go;
- ``release()``, after each pass's backward and after the optimizer step: ``malloc_trim(0)``,
  which hands the free pages inside every arena back to the system.

Smaller blocks keep coming from the heap (the cost of mapping every tensor: page faults on
each; a 1 MiB threshold made steps 24-38 % slower). ``--heap default`` leaves glibc as it is.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_MMAP_THRESHOLD = -3  # mallopt's parameter number (glibc's malloc.h)
MMAP_THRESHOLD = 8 * 1024 * 1024
HEAP_MODES = ("release", "default")


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, when this process runs on it (malloc_trim and mallopt are its own)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        libc.malloc_trim  # noqa: B018
        libc.mallopt  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


@functools.cache
def configure() -> bool:
    """Fix glibc's mmap threshold (once per process); False where that is not glibc."""
    libc = _libc()
    return libc is not None and bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))


def release() -> bool:
    """Hand the heap's free pages back to the system; False where nothing was released."""
    libc = _libc()
    return libc is not None and bool(libc.malloc_trim(0))
