"""A worker's session table: open sessions, starts under way, tombstones, and their expiry.

A session ends three ways: its client closes it (the worker's request handling, then
``forget``), the environment fails (``end``), or it expires (``sweep`` by the janitor: idle for
``idle_timeout_s``, or past its deadline; or the drain's grace ran out). Every end closes the
environment once, and leaves a tombstone for ``closed_memory_s``: why it ended, and the answer
its close got, so a retried close gets the same answer and a late step a clear 404.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import structlog

from .base import Environment
from .config import EnvWorkerConfig
from .metrics import EnvMetrics
from .stats import WorkerCounters

log = structlog.get_logger("agentarium.environments")


@dataclass(eq=False)
class Session:
    session_id: str
    env: Environment
    deadline_at: float  # time.monotonic()
    last_active: float
    started_reply: bytes  # answered again to a retried start
    job_id: str = ""
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    last_seq: int = 0
    last_reply: bytes | None = None
    steps: int = 0
    closed: bool = False
    expiring: bool = False  # the janitor is closing it


@dataclass(frozen=True)
class Tombstone:
    """What is left of a closed session: why it ended, and the answer its close got (the reply,
    or the error code and message), so a retried close gets the same answer."""

    until: float
    reason: str
    reply: bytes | None = None
    error: tuple[int, str] | None = None


EXPIRY_REASONS = {
    "idle": "expired: idle for more than {idle:g} s",
    "deadline": "expired: its deadline passed",
    "drain": "closed by the worker's drain (SIGTERM)",
}


class SessionTable:
    """The sessions of one worker; ``on_change`` is called whenever their number changes."""

    def __init__(
        self,
        config: EnvWorkerConfig,
        counters: WorkerCounters,
        metrics: EnvMetrics,
        *,
        on_change: Callable[[], None],
        spawn: Callable[[Coroutine[Any, Any, None]], None],
    ) -> None:
        self.config = config
        self.open: dict[str, Session] = {}
        self.starting: set[str] = set()
        self.tombstones: dict[str, Tombstone] = {}
        self.empty = asyncio.Event()
        self._counters = counters
        self._metrics = metrics
        self._on_change = on_change
        self._spawn = spawn

    def __len__(self) -> int:
        return len(self.open)

    def get(self, session_id: str) -> Session | None:
        return self.open.get(session_id)

    def fits(self) -> bool:
        """Room for one more session, counting those still starting."""
        return len(self.open) + len(self.starting) < self.config.capacity

    def changed(self) -> None:
        if not self.open and not self.starting:
            self.empty.set()
        else:
            self.empty.clear()
        self._on_change()

    # ---- starting ------------------------------------------------------------------------
    def begin(self, session_id: str) -> None:
        self.starting.add(session_id)
        self.changed()

    def abandon(self, session_id: str) -> None:
        """A start that failed: its slot frees."""
        self.starting.discard(session_id)
        self.changed()

    def add(self, session: Session) -> None:
        """A start that succeeded: the session is open."""
        self.open[session.session_id] = session
        self.starting.discard(session.session_id)
        self._metrics.sessions.inc()
        self.changed()

    # ---- ending --------------------------------------------------------------------------
    def forget(
        self,
        session: Session,
        reason: str,
        reply: bytes | None = None,
        *,
        error: tuple[int, str] | None = None,
    ) -> None:
        session.closed = True
        if self.open.pop(session.session_id, None) is not None:
            self._metrics.sessions.dec()
        until = time.monotonic() + self.config.closed_memory_s
        self.tombstones[session.session_id] = Tombstone(until, reason, reply, error)
        self.changed()

    async def end(self, session: Session, reason: str, *, expired: bool = False) -> None:
        """Close the environment of a session that ends without its client's close."""
        session.closed = True
        if expired:
            self._counters.expired += 1
            self._metrics.expired.inc()
        await self.close_env(session.env, reason, session.session_id)
        self.forget(session, reason)

    async def close_env(self, env: Environment, reason: str, session_id: str = "") -> None:
        try:
            await asyncio.wait_for(env.close(), self.config.close_timeout_s)
        except Exception:  # noqa: BLE001 - ending anyway: log and let go
            log.warning(
                "environment close raised", session=session_id, reason=reason, exc_info=True
            )

    async def expire(self, session: Session, why: str) -> None:
        """End ``session`` for ``why`` (a key of EXPIRY_REASONS), unless a request came in
        since the janitor looked."""
        async with session.lock:
            session.expiring = False
            now = time.monotonic()
            still = {
                "idle": now - session.last_active >= self.config.idle_timeout_s,
                "deadline": now >= session.deadline_at,
                "drain": True,
            }
            if session.closed or not still[why]:  # a request came in meanwhile
                return
            log.info("session expired", session=session.session_id, why=why)
            reason = EXPIRY_REASONS[why].format(idle=self.config.idle_timeout_s)
            await self.end(session, reason, expired=True)

    async def expire_all(self) -> None:
        """The drain's grace is over: close what is left."""
        await asyncio.gather(*(self.expire(s, "drain") for s in list(self.open.values())))

    # ---- the janitor ---------------------------------------------------------------------
    async def janitor(self, stopped: asyncio.Event) -> None:
        while not stopped.is_set():
            await asyncio.sleep(self.config.janitor_interval_s)
            self.sweep()

    def sweep(self) -> None:
        """Expire idle sessions and those past their deadline; forget old tombstones."""
        now = time.monotonic()
        for session in list(self.open.values()):
            if session.lock.locked() or session.expiring:
                continue  # a step is running (its own deadline bounds it), or already going
            if now >= session.deadline_at:
                session.expiring = True
                self._spawn(self.expire(session, "deadline"))
            elif now - session.last_active >= self.config.idle_timeout_s:
                session.expiring = True
                self._spawn(self.expire(session, "idle"))
        for session_id, tomb in list(self.tombstones.items()):
            if tomb.until <= now:
                del self.tombstones[session_id]
