"""Which nats-server we talk to or launch, and the newer features it has.

The floor is nats-server 2.9 (Debian's 2.9.10). Newer servers are used for what they add:
``sync_interval`` (2.10: fsync on a schedule, or on every write) when the launcher writes a
config, per-message TTLs (2.11: ``Nats-TTL``) for the workers registry, byte limits on the
discard-new job queue (2.10.5: before it, a full queue dropped its oldest jobs). Each use checks the
version first and falls back to what 2.9 does.
"""

from __future__ import annotations

import functools
import re
import subprocess
from typing import Any

Version = tuple[int, int, int]

SYNC_INTERVAL_SINCE: Version = (2, 10, 0)
MSG_TTL_SINCE: Version = (2, 11, 0)
# Before 2.10.5 the file store checks a discard-new byte limit against the payload's size,
# stores the message at its full size, then deletes the stream's OLDEST messages to get back
# under the limit (nats-server bf8ac377f, "Fix DiscardNew exceed bytes calculation"): a full
# work queue loses jobs silently. Found by tests/chaos' store-full scenario.
DISCARD_NEW_BYTES_SINCE: Version = (2, 10, 5)
UNKNOWN: Version = (0, 0, 0)

_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


def parse_version(text: str) -> Version:
    """``"2.9.10"``, ``"v2.15.1"`` or ``"nats-server: v2.15.1"``; ``UNKNOWN`` if none."""
    match = _VERSION.search(text or "")
    if match is None:
        return UNKNOWN
    major, minor, patch = (int(g) for g in match.groups())
    return (major, minor, patch)


def format_version(version: Version) -> str:
    return "unknown" if version == UNKNOWN else ".".join(map(str, version))


def server_version(nc: Any) -> Version:
    """The version the connected server announced in its INFO (``UNKNOWN`` if none yet)."""
    info = getattr(nc, "_server_info", None) or {}  # nats-py: the last INFO, a plain dict
    return parse_version(str(info.get("version", "")))


def js_server_version(js: Any) -> Version:
    """``server_version`` of a JetStream context's connection (nats-py keeps no public handle
    on it: the one place that reaches for ``_nc``)."""
    return server_version(js._nc)


@functools.lru_cache(maxsize=16)
def binary_version(binary: str) -> Version:
    """``nats-server --version`` of a binary (cached per path); ``UNKNOWN`` if it says none."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    return parse_version(out.stdout + out.stderr)
