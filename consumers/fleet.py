"""The LLM fleet of one consumer: a circuit breaker per server, the fleet's state, and the
wait that holds rollouts through an outage instead of failing them.

``Fleet`` wraps a backend (``SGLangBackend``, ``OpenAICompatBackend``) and is one itself. Each
server's breaker is driven by a health probe with a short timeout (SGLang's ``GET /health``,
``GET /v1/models`` for OpenAI-compatible servers), never by the long request timeout, so a
server that accepts connections and never answers is found in seconds::

    server  closed --probe_failures probes in a row fail--> open (skipped; its requests in
            flight are cut off and fail over)
            closed --a call found every server failing, and this one fails one probe--> open
            open --a probe answers (the half-open trial, re-probed with backoff)--> closed
    fleet   up --every breaker open--> down --one breaker closes--> up
            down --outage_limit_s passes--> down past its limit

While the fleet is down within its limit it *holds*: ``generate`` waits for the fleet instead of
raising ``BackendUnavailable``, rollout deadlines stand still (``DeadlineClock``), and the
worker pulls no new jobs. Held rollouts keep their delivery (heartbeats keep the job's ack
deadline), so no attempt is spent. Past the limit, calls fail as errors again, as without
this module, until the fleet comes back. A server that answers calls needs no probe.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from agentarium.broker import Backoff, cancel_and_wait
from agentarium.schemas import check_settings, setting

from .backends.base import GenerateChunk, GenerateRequest, GenerateResult, OnChunk, streams
from .errors import BackendUnavailable
from .metrics import FLEET_DOWN_SECONDS, FLEET_OUTAGES, FLEET_UP, SERVER_UP, backend_label
from .redact import log_safe

log = structlog.get_logger("agentarium.consumers")


@dataclass(frozen=True, kw_only=True)
class FleetPolicy:
    """How a consumer watches its LLM fleet. ``outage_limit_s`` 0 never holds (errors at once,
    as before fleet handling); ``inf`` holds for ever."""

    outage_limit_s: float = setting(
        300.0,
        ge=0,
        flag="--fleet-outage-limit",
        help="when every LLM server stops answering, pull no new jobs and hold in-flight "
        "rollouts (no attempt spent, deadlines paused) until one answers; only an outage longer "
        "than this fails them as errors. 0: never hold, inf: hold for ever",
    )
    probe_interval_s: float = setting(
        5.0,
        gt=0,
        flag="--fleet-probe-interval",
        help="health probe (GET /health) period of each LLM server not answering calls",
    )
    probe_timeout_s: float = setting(
        5.0,
        gt=0,
        flag="--fleet-probe-timeout",
        help="a server that does not answer its probe within this long is skipped, and its "
        "requests in flight fail over (two misses in a row)",
    )
    probe_failures: int = setting(
        2, ge=1, flagless="failed probes in a row that open a closed breaker; rarely changed"
    )
    backoff_s: float = setting(
        0.5, gt=0, flagless="an open breaker is re-probed after this, doubling up to max_backoff_s"
    )
    max_backoff_s: float = setting(
        10.0, gt=0, flagless="the longest wait before an open breaker is re-probed"
    )

    def __post_init__(self) -> None:
        check_settings(self)
        if not 0 < self.backoff_s <= self.max_backoff_s:
            raise ValueError("need 0 < backoff_s <= max_backoff_s")

    @property
    def holds(self) -> bool:
        return self.outage_limit_s > 0

    def backoff(self, failures: int) -> float:
        """Seconds before re-probing an open breaker after ``failures`` failed probes."""
        return Backoff(initial_s=self.backoff_s, max_s=self.max_backoff_s).delay(failures)


class DeadlineClock:
    """A rollout's deadline (an entered ``asyncio.timeout``) that stands still while a fleet
    it uses holds: paused by each fleet going down, running again when the last one resumes."""

    def __init__(self, timeout: asyncio.Timeout) -> None:
        self._timeout = timeout
        self._pauses = 0
        self._left: float | None = None

    def pause(self) -> None:
        self._pauses += 1
        when = self._timeout.when()
        if self._pauses == 1 and when is not None:
            loop = asyncio.get_running_loop()
            try:
                self._timeout.reschedule(None)
            except RuntimeError:  # expiring or exited: too late to stop it
                return
            self._left = max(0.0, when - loop.time())

    def resume(self) -> None:
        self._pauses = max(0, self._pauses - 1)
        if self._pauses == 0 and self._left is not None:
            left, self._left = self._left, None
            try:
                self._timeout.reschedule(asyncio.get_running_loop().time() + left)
            except RuntimeError:  # exited meanwhile
                pass


class Fleet:
    """A backend whose calls wait out an outage of its servers (see the module docstring)."""

    def __init__(
        self,
        backend: Any,
        *,
        agent: str,
        name: str = "llm",
        policy: FleetPolicy | None = None,
    ) -> None:
        if not supports(backend):
            raise TypeError(f"{backend!r} has no servers to probe (servers, probe, open_breaker)")
        self.backend = backend
        self.agent = agent
        self.name = name
        self.policy = policy or FleetPolicy()
        self.servers: list[str] = list(backend.servers)
        self._open: dict[str, str] = {}  # server -> why its breaker opened
        # server -> why it is held out: its weight syncer found it not serving what it
        # reports (consumers/backends/engine_holds.py); its probe fails until that is lifted
        self._quarantined: dict[str, str] = {}
        self.down_since: float | None = None  # loop time the fleet went down
        self._down_at = 0.0  # the same as wall time, for the registry
        self.past_limit = False
        self.outages = 0
        self._serving = asyncio.Event()
        self._serving.set()
        self._clocks: set[DeadlineClock] = set()
        self._kick = {url: asyncio.Event() for url in self.servers}
        self._tasks: list[asyncio.Task] = []
        self._limit_timer: asyncio.TimerHandle | None = None
        self._recheck: asyncio.Task | None = None
        self.listeners: list[Callable[[], None]] = []  # called when the fleet goes down or up
        self._up = FLEET_UP.labels(agent, name)
        self._up.set(1)
        for url in self.servers:
            SERVER_UP.labels(backend_label(url)).set(1)

    # ---- the backend face ----------------------------------------------------------------
    @property
    def provider_name(self) -> str:
        return str(getattr(self.backend, "provider_name", "") or "unknown")

    @property
    def streams(self) -> bool:
        return streams(self.backend)

    async def generate(
        self, request: GenerateRequest, on_chunk: OnChunk | None = None
    ) -> GenerateResult:
        handed = False  # a chunk went on: the caller acted on it, so never call again

        def relay(chunk: GenerateChunk) -> None:
            nonlocal handed
            handed = True
            on_chunk(chunk)  # type: ignore[misc]

        while True:
            if self.holding:
                await self._serving.wait()
            outages = self.outages
            try:
                if on_chunk is None or not self.streams:
                    return await self.backend.generate(request)
                return await self.backend.generate(request, on_chunk=relay)
            except BackendUnavailable:
                if not self.policy.holds or self.past_limit or handed:
                    raise
                # The fleet went down during the call (it may be back already), or a probe of
                # every server now finds it down: wait for it and call again. Otherwise a
                # server answers: the failure was this request's own.
                if self.outages == outages and not await self.confirm_down():
                    raise

    async def start(self) -> Fleet:
        if not self._tasks:
            self._tasks = [
                asyncio.create_task(self._watch(url), name=f"fleet-probe-{backend_label(url)}")
                for url in self.servers
            ]
        return self

    async def aclose(self) -> None:
        if self._recheck is not None:
            self._recheck.cancel()
        # a probe naps in 3.11's wait_for, which swallows a cancel that meets a kick
        await cancel_and_wait(self._tasks)
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        if self._limit_timer is not None:
            self._limit_timer.cancel()
        self._serving.set()  # nobody may wait on a closed fleet
        await self.backend.aclose()

    # ---- state ----------------------------------------------------------------------------
    @property
    def down(self) -> bool:
        return self.down_since is not None

    @property
    def holding(self) -> bool:
        """Down, within the outage limit: calls wait and the worker pulls nothing."""
        return self.down and self.policy.holds and not self.past_limit

    async def wait_serving(self) -> None:
        """Until the fleet no longer holds (it is back, or its outage passed the limit)."""
        await self._serving.wait()

    def snapshot(self) -> dict[str, Any]:
        """The fleet's state for the workers registry (``broker status``)."""
        return {
            "state": "down" if self.down else "up",
            "down_for_s": round(time.time() - self._down_at, 1) if self.down else 0.0,
            "past_limit": self.past_limit,
            "servers": len(self.servers),
            "servers_down": len(self._open),
        }

    def _track(self, clock: DeadlineClock) -> None:
        self._clocks.add(clock)
        if self.holding:
            clock.pause()

    def _untrack(self, clock: DeadlineClock) -> None:
        self._clocks.discard(clock)

    async def confirm_down(self) -> bool:
        """A call just failed on every server: probe them all now (one probe shared by every
        call that asks meanwhile); True when none answers, so the fleet is down."""
        if self._recheck is None or self._recheck.done():
            self._recheck = asyncio.create_task(self._probe_all())
        await asyncio.shield(self._recheck)
        return self.down

    async def _probe_all(self) -> None:
        errors = await asyncio.gather(*(self._probe(u) for u in self.servers))
        for url, error in zip(self.servers, errors, strict=True):
            if error:
                self._trip(url, error)
                self._kick[url].set()  # its watch switches to the re-probe backoff
            else:
                self._close(url)

    # ---- probing ---------------------------------------------------------------------------
    async def _watch(self, url: str) -> None:
        policy = self.policy
        failures = 0
        while True:
            if (
                url not in self._open
                and url not in self._quarantined
                and self._answered_recently(url)
            ):
                failures = 0
                await self._nap(url, policy.probe_interval_s)
                continue
            error = await self._probe(url)
            if not error:
                failures = 0
                self._close(url)
                await self._nap(url, policy.probe_interval_s)
                continue
            failures += 1
            if url in self._open or failures >= policy.probe_failures:
                self._trip(url, error)
                await self._nap(url, policy.backoff(failures - policy.probe_failures + 1))
            else:  # one failed probe: look again soon before opening the breaker
                await self._nap(url, policy.backoff_s)

    def quarantine(self, url: str, why: str) -> None:
        """Hold ``url`` out until ``unquarantine``: its breaker opens at its next probe (now)."""
        if url in self._kick and self._quarantined.get(url) != why:
            self._quarantined[url] = why
            self._trip(url, f"held out of the fleet: {why}")
            self._kick[url].set()

    def unquarantine(self, url: str) -> None:
        """``url`` serves what it reports again: its next probe (now) may close its breaker."""
        if self._quarantined.pop(url, None) is not None:
            self._kick[url].set()

    async def _probe(self, url: str) -> str:
        """The backend's probe of ``url``: "" when it answers, else why not (never raises)."""
        if url in self._quarantined:
            return f"held out of the fleet: {self._quarantined[url]}"
        try:
            return str(await self.backend.probe(url, self.policy.probe_timeout_s))
        except Exception as exc:  # noqa: BLE001 - a probe that breaks is a probe that failed
            return f"probe failed: {type(exc).__name__}: {exc}"

    def _answered_recently(self, url: str) -> bool:
        answered = getattr(self.backend, "answered_at", {}).get(url, 0.0)
        return time.monotonic() - answered < self.policy.probe_interval_s

    async def _nap(self, url: str, seconds: float) -> None:
        kick = self._kick[url]
        try:
            await asyncio.wait_for(kick.wait(), seconds)
        except TimeoutError:
            pass
        kick.clear()

    # ---- transitions -----------------------------------------------------------------------
    def _trip(self, url: str, error: str) -> None:
        if url in self._open:
            self._open[url] = error
            return
        self._open[url] = error
        cut = self.backend.open_breaker(url)
        SERVER_UP.labels(backend_label(url)).set(0)
        log.warning(
            "llm_server_down",
            agent=self.agent,
            fleet=self.name,
            server=backend_label(url),
            error=log_safe(error),
            requests_cut_off=cut,
            servers_down=f"{len(self._open)}/{len(self.servers)}",
        )
        if len(self._open) == len(self.servers):
            self._fleet_down()

    def _close(self, url: str) -> None:
        if url not in self._open:
            return
        del self._open[url]
        self.backend.close_breaker(url)
        SERVER_UP.labels(backend_label(url)).set(1)
        log.info(
            "llm_server_up",
            agent=self.agent,
            fleet=self.name,
            server=backend_label(url),
            servers_down=f"{len(self._open)}/{len(self.servers)}",
        )
        if self.down:
            self._fleet_up()

    def _fleet_down(self) -> None:
        loop = asyncio.get_running_loop()
        self.down_since, self._down_at = loop.time(), time.time()
        self.past_limit = False
        self.outages += 1
        self._up.set(0)
        FLEET_OUTAGES.labels(self.agent, self.name).inc()
        log.warning(
            "fleet_down",
            agent=self.agent,
            fleet=self.name,
            servers=len(self.servers),
            errors={backend_label(u): log_safe(e) for u, e in self._open.items()},
            action=(
                f"pulling paused, rollouts held for up to {self.policy.outage_limit_s:g}s"
                if self.policy.holds
                else "not held (--fleet-outage-limit 0): rollouts fail as errors"
            ),
        )
        self._notify()
        if not self.policy.holds:
            return
        self._serving.clear()
        for clock in self._clocks:
            clock.pause()
        if self.policy.outage_limit_s != float("inf"):
            self._limit_timer = loop.call_later(self.policy.outage_limit_s, self._limit_passed)

    def _limit_passed(self) -> None:
        self._limit_timer = None
        if not self.holding:
            return
        self.past_limit = True
        log.error(
            "fleet_outage_limit",
            agent=self.agent,
            fleet=self.name,
            down_s=round(asyncio.get_running_loop().time() - (self.down_since or 0.0), 1),
            limit_s=self.policy.outage_limit_s,
            action="held rollouts and new ones fail as errors until the fleet answers",
        )
        self._notify()
        self._release()

    def _fleet_up(self) -> None:
        loop = asyncio.get_running_loop()
        held = self.holding
        down_s = loop.time() - (self.down_since or loop.time())
        self.down_since = None
        self.past_limit = False
        if self._limit_timer is not None:
            self._limit_timer.cancel()
            self._limit_timer = None
        self._up.set(1)
        FLEET_DOWN_SECONDS.labels(self.agent, self.name).inc(down_s)
        log.info("fleet_up", agent=self.agent, fleet=self.name, down_s=round(down_s, 1))
        self._notify()
        if held:
            self._release()

    def _notify(self) -> None:
        for listener in self.listeners:
            listener()

    def _release(self) -> None:
        for clock in self._clocks:
            clock.resume()
        self._serving.set()

    def __repr__(self) -> str:
        state = "up" if not self.down else "down past limit" if self.past_limit else "down"
        return (
            f"Fleet({self.agent}/{self.name}: {state}, "
            f"{len(self._open)}/{len(self.servers)} open, {self.backend!r})"
        )


def supports(backend: Any) -> bool:
    """Whether ``backend`` has servers a ``Fleet`` can probe and breakers it can open."""
    return all(hasattr(backend, name) for name in ("servers", "probe", "open_breaker"))


class deadline_held_by:  # noqa: N801 - used as a function: ``with deadline_held_by(...)``
    """While inside, ``timeout`` (entered) stands still whenever one of ``fleets`` holds.

    A class rather than a generator over an ExitStack: entered once per rollout."""

    __slots__ = ("_clock", "_fleets", "_entered")

    def __init__(self, fleets: Sequence[Fleet], timeout: asyncio.Timeout) -> None:
        self._clock = DeadlineClock(timeout)
        self._fleets = fleets
        self._entered: list[Fleet] = []

    def __enter__(self) -> None:
        try:
            for fleet in self._fleets:
                fleet._track(self._clock)
                self._entered.append(fleet)
        except BaseException:
            self.__exit__(None, None, None)
            raise

    def __exit__(self, *exc: object) -> None:
        for fleet in reversed(self._entered):
            fleet._untrack(self._clock)
        self._entered.clear()


def fleets_summary(fleets: Sequence[Fleet]) -> dict[str, Any]:
    """One agent's fleets (its model's, a cross-sampling model's) as one registry entry."""
    snaps = [fleet.snapshot() for fleet in fleets]
    down = [s for s in snaps if s["state"] == "down"]
    return {
        "state": "down" if down else "up",
        "down_for_s": max((s["down_for_s"] for s in down), default=0.0),
        "past_limit": any(s["past_limit"] for s in down),
        "servers": sum(s["servers"] for s in snaps),
        "servers_down": sum(s["servers_down"] for s in snaps),
    }
