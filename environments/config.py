"""EnvWorkerConfig: every setting of one environment worker, declared once.

``agentarium env serve``'s and ``env bridge``'s flags and file keys are these fields
(schemas.settings), so a default lives here and nowhere else.
"""

from __future__ import annotations

import dataclasses
import os
import re
import socket
import uuid
from dataclasses import dataclass
from importlib import metadata

from agentarium.schemas import check_name, check_settings, setting


def default_worker_id() -> str:
    """host-pid-random, as a subject token (a host name's dots become dashes)."""
    host = re.sub(r"[^A-Za-z0-9_-]", "-", socket.gethostname())[:80] or "host"
    return f"{host}-{os.getpid()}-{uuid.uuid4().hex[:6]}"


def agentarium_version() -> str:
    try:
        return metadata.version("agentarium")
    except metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree
        return "0.0.0"


@dataclass(frozen=True, kw_only=True)
class EnvWorkerConfig:
    """One worker's settings (``agentarium env serve``'s and ``env bridge``'s flags)."""

    # "" until the command chooses it (``named``): a worker refuses to serve without one.
    name: str = setting(
        "",
        help="the name agents open sessions with (default: the built-in's name, else the "
        "class's `name`, else its name in lower case; `agentbench` for env bridge)",
    )
    capacity: int = setting(
        64, ge=1, help="sessions this worker holds at once; when full it takes no start"
    )
    max_starting: int = setting(
        8,
        ge=1,
        metavar="K",
        help="starts (resets) run at once, so expensive environments start a few at a time",
    )
    idle_timeout_s: float = setting(
        300.0, gt=0, help="a session with no request for this long is closed"
    )
    # Well below the default max_payload (1 MiB; 8 MB in ops/nats): a bigger observation is cut.
    max_observation_bytes: int = setting(
        256 * 1024,
        ge=4096,
        metavar="B",
        help="the most bytes of one reply; a bigger observation has its longest texts cut, "
        "with a marker, and says truncated. Keep it well under the server's max_payload",
    )
    max_request_bytes: int = setting(
        1024 * 1024,
        ge=1,
        metavar="B",
        help="a step or close bigger than this is refused with 413",
    )
    drain_grace_s: float = setting(
        600.0,
        ge=0,
        help="on SIGTERM, how long open sessions may finish before they are closed",
    )
    worker_id: str = setting(
        factory=default_worker_id,
        help="this worker's id, a subject token (default: host-pid-random)",
    )
    close_timeout_s: float = setting(
        30.0, gt=0, flagless="how long an environment's close may take before it is let go"
    )
    janitor_interval_s: float = setting(
        1.0, gt=0, flagless="how often idle and overdue sessions are looked for"
    )
    closed_memory_s: float = setting(
        120.0, ge=0, flagless="how long a closed session's answer is kept for a retried close"
    )
    start_linger_s: float = setting(
        2.0,
        ge=0,
        flagless="how long a start subscription given up (full) still answers what the server "
        "had routed to it (environments/admission.py)",
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if self.name:
            check_name(self.name, "env")
        check_name(self.worker_id, "worker")

    def named(self, name: str) -> EnvWorkerConfig:
        """These settings for the environment served as ``name``."""
        return dataclasses.replace(self, name=name)
