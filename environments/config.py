"""An environment worker's settings."""

from __future__ import annotations

import os
import re
import socket
import uuid
from dataclasses import dataclass, field
from importlib import metadata

from schemas import check_name


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
    """One worker's settings (``agentarium env serve``'s flags)."""

    name: str
    capacity: int = 64
    max_starting: int = 8
    idle_timeout_s: float = 300.0
    # Well below the default max_payload (1 MiB; 8 MB in ops/nats): a bigger observation is cut.
    max_observation_bytes: int = 256 * 1024
    max_request_bytes: int = 1024 * 1024
    drain_grace_s: float = 600.0
    close_timeout_s: float = 30.0
    worker_id: str = field(default_factory=default_worker_id)
    janitor_interval_s: float = 1.0
    closed_memory_s: float = 120.0  # a retried close still gets its outcome this long
    # A start subscription given up (full) still answers this long: see EnvWorker._follow_room
    start_linger_s: float = 2.0

    def __post_init__(self) -> None:
        check_name(self.name, "env")
        check_name(self.worker_id, "worker")
        if self.capacity < 1 or self.max_starting < 1:
            raise ValueError("capacity and max_starting must be >= 1")
        if self.idle_timeout_s <= 0 or self.janitor_interval_s <= 0:
            raise ValueError("idle_timeout_s and janitor_interval_s must be > 0")
        if self.max_observation_bytes < 4096:
            raise ValueError("max_observation_bytes must be >= 4096")
