"""The weight syncer: keeps a fleet of engines on a run's latest policy version.

It runs beside the engines, sharing their filesystem (SGLang reads new weights from its own
disk). It watches the policy KV key ``<run>`` (the initial value included), and for each new
WeightUpdate:

1. asks every engine its ``/model_info`` ``weight_version`` and leaves alone those already at
   this version or a newer one;
2. gets the safetensors (inference.WeightFetcher) into ``<weights_dir>/<run>/v<version>/model.safetensors`` (streamed from
   the object store, or copied from the trainer's shared path) and verifies its sha256 — or, with
   ``shared_path``, verifies the trainer's file in place and loads it from there;
3. reloads each engine that needs it, concurrently, with one sequence for SGLang and the local
   engine alike (inference.EngineControl): ``POST /pause_generation {"mode": "in_place"}`` →
   ``POST /update_weights_from_disk {"model_path", "load_format": null, "weight_version",
   "flush_cache": true, "abort_all_requests": false}`` → ``POST /continue_generation {}``, the
   last one sent whatever happened before it, so a failed update never leaves an engine paused;
   A LoRA trainer's version is an adapter (its safetensors header carries the adapter config,
   ``inference.lora_config_of``): the syncer makes a PEFT adapter directory of it
   (``<weights_dir>/<run>/v<version>/lora/``) and sends, inside the same pause and continue,
   ``POST /unload_lora_adapter {"lora_name": <run>}`` (a refusal, nothing loaded yet, is fine)
   → ``POST /load_lora_adapter {"lora_name": <run>, "lora_path"}`` → ``POST
   /update_weight_version {"new_version"}``, so generations that name the adapter (the
   consumer's ``--lora <run>``) report the adapter's version;
4. keeps the newest ``keep`` local copies;
5. records what each engine serves now in the engines KV (``inference.record_engine``), for
   live views; a record that cannot be written is logged and skipped.

Updates that arrive while a reload runs are coalesced: only the newest is applied next. Every
``recheck_s`` the syncer also reads the KV key directly (a watch that silently died after a
broker restart is then replaced) and re-checks the engines, so an engine that restarted on its
original weights is brought back to the current version. A version whose bytes fail
verification, or were pruned before we fetched them, is not retried; the next one is.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext

from agentarium.broker import Backoff, Topology
from agentarium.schemas import SchemaError, WeightUpdate, decode, version_number

from ..control import EngineControl, EngineControlError
from ..engines import record_engine
from ..weights import (
    WeightFetcher,
    WeightNotFound,
    WeightsError,
    WeightVerificationError,
    adapter_directory,
    is_shared_path,
    local_versions,
    lora_config_of,
    verify_file,
)
from .config import SyncConfig
from .metrics import SYNC_SEEN, record_sync_round

log = structlog.get_logger("agentarium.sync")

WATCH_BACKOFF = Backoff(initial_s=0.5, max_s=10.0)  # re-creating a failed policy watch


@dataclass(frozen=True)
class EngineResult:
    """What happened to one engine for one version: ``updated``, ``skipped`` or ``failed``."""

    url: str
    status: str
    before: str | None
    message: str = ""
    seconds: float = 0.0


@dataclass(frozen=True)
class SyncResult:
    version: int
    engines: tuple[EngineResult, ...]
    model_path: str | None = None
    fetch_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(r.status != "failed" for r in self.engines)

    def __str__(self) -> str:
        lines = [f"version {self.version}: " + ("ok" if self.ok else "FAILED")]
        for r in self.engines:
            lines.append(f"  {r.url}: {r.status} (was {r.before}) {r.message}".rstrip())
        return "\n".join(lines)


@dataclass
class SyncCounters:
    seen: int = 0
    applied: int = 0
    failed: int = 0
    bad_versions: set[int] = field(default_factory=set)


class WeightSyncer:
    """Watches the policy KV for ``config.run`` and reloads ``config.engines``.

    ``await syncer.run()`` until ``syncer.stop()``; ``await syncer.sync_once()`` applies the
    current version once (the run-until-done mode scripts and tests use).
    """

    def __init__(
        self,
        js: JetStreamContext,
        config: SyncConfig,
        *,
        topology: Topology | None = None,
        store: WeightFetcher | None = None,
        control: EngineControl | None = None,
    ) -> None:
        self.js = js
        self.config = config
        self.topology = topology or Topology()
        self.store = store or WeightFetcher(js, self.topology)
        self.control = control or EngineControl()
        self.counters = SyncCounters()
        self.last_result: SyncResult | None = None
        self._latest: WeightUpdate | None = None
        self._wake = asyncio.Event()
        self._stopping = False
        self._ready: dict[int, Path] = {}  # versions fetched and verified: their directories

    def __repr__(self) -> str:
        c = self.counters
        latest = None if self._latest is None else self._latest.version
        return (
            f"<WeightSyncer run={self.config.run} engines={len(self.config.engines)} "
            f"latest={latest} seen={c.seen} applied={c.applied} failed={c.failed}>"
        )

    async def close(self) -> None:
        await self.control.close()

    async def __aenter__(self) -> WeightSyncer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def stop(self) -> None:
        """Ask ``run()`` to return once the reload in progress, if any, has finished."""
        self._stopping = True
        self._wake.set()

    # ---- the service loop --------------------------------------------------------------------

    async def run(self) -> None:
        log.info("weight syncer starting", **self.config.describe())
        watch = asyncio.create_task(self._watch(), name="policy-watch")
        try:
            while not self._stopping:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.config.recheck_s)
                self._wake.clear()
                if self._stopping or self._latest is None:
                    continue
                if self._latest.version in self.counters.bad_versions:
                    continue  # reported once; wait for the next version
                try:
                    await self.apply(self._latest)
                except Exception:  # one bad round must not end the service
                    log.exception("sync round failed", version=self._latest.version)
        finally:
            watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watch
            await self.close()
            log.info("weight syncer stopped", syncer=repr(self))

    async def sync_once(self) -> SyncResult | None:
        """Apply the run's current version to every engine; None when nothing is published."""
        update = await self.store.latest(self.config.run)
        if update is None:
            log.info("nothing published yet", run=self.config.run)
            return None
        self._offer(update)
        try:
            return await self.apply(update)
        finally:
            await self.close()

    async def _watch(self) -> None:
        """Feed ``_offer`` from a KV watch, re-created after any failure; poll when idle."""
        failures = 0
        while True:
            watcher = None
            try:
                kv = await self.js.key_value(self.topology.policy_bucket)
                watcher = await kv.watch(self.config.run)
                failures = 0
                while True:
                    try:
                        entry = await watcher.updates(timeout=self.config.recheck_s)
                    except nats.errors.TimeoutError:
                        try:
                            entry = await kv.get(self.config.run)
                        except nats.js.errors.KeyNotFoundError:
                            entry = None
                    if entry is not None and entry.value:
                        self._offer_bytes(entry.value)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures += 1
                wait = WATCH_BACKOFF.delay(failures)
                log.warning(
                    "policy watch failed; retrying",
                    error=str(exc) or type(exc).__name__,
                    retry_in_s=round(wait, 3),
                )
                await asyncio.sleep(wait)
            finally:
                if watcher is not None:
                    with contextlib.suppress(Exception):
                        await watcher.stop()

    def _offer_bytes(self, payload: bytes) -> None:
        try:
            update = decode(WeightUpdate, payload)
        except SchemaError as exc:
            log.error("policy KV holds an invalid WeightUpdate; ignored", error=str(exc))
            return
        self._offer(update)

    def _offer(self, update: WeightUpdate) -> None:
        if update.run != self.config.run:
            log.warning("WeightUpdate for another run ignored", run=update.run)
            return
        current = self._latest
        if current is not None and update.version <= current.version:
            if update.version < current.version:
                log.warning(
                    "older version published after a newer one; ignored (a trainer restarted "
                    "without --resume?)",
                    version=update.version,
                    latest=current.version,
                )
            return
        self._latest = update
        self.counters.seen += 1
        SYNC_SEEN.labels(self.config.run).set(update.version)
        self._wake.set()

    # ---- one version -------------------------------------------------------------------------

    async def apply(self, update: WeightUpdate) -> SyncResult:
        """Bring every engine to ``update`` (engines at it or newer are skipped)."""
        before = await asyncio.gather(*(self._engine_version(u) for u in self.config.engines))
        results: dict[str, EngineResult] = {}
        need = []
        for url, version in zip(self.config.engines, before, strict=True):
            number = _as_number(version)
            if number is not None and number >= update.version:
                results[url] = EngineResult(url, "skipped", version, "already at this version")
                if number > update.version:
                    log.warning(
                        "engine is ahead of the published version; left alone",
                        engine=url,
                        engine_version=version,
                        version=update.version,
                    )
            else:
                need.append((url, version))
        model_dir: Path | None = None
        fetch_s = 0.0
        if need:
            started = time.perf_counter()
            try:
                model_dir = await self._weights_for(update)
            except WeightsError as exc:
                if isinstance(exc, WeightVerificationError | WeightNotFound):
                    self.counters.bad_versions.add(update.version)
                log.error("weights unavailable", version=update.version, error=str(exc))
                for url, version in need:
                    results[url] = EngineResult(url, "failed", version, str(exc))
                need = []
            fetch_s = time.perf_counter() - started
        reloads = await asyncio.gather(
            *(self._reload(url, version, model_dir, update) for url, version in need)
        )
        for result in reloads:
            results[result.url] = result
        out = SyncResult(
            version=update.version,
            engines=tuple(results[u] for u in self.config.engines),
            model_path=None if model_dir is None else str(model_dir),
            fetch_s=round(fetch_s, 3),
        )
        record_sync_round(
            update.run,
            [
                (
                    r.url,
                    r.status,
                    r.seconds,
                    update.version if r.status == "updated" else _as_number(r.before),
                )
                for r in out.engines
            ],
            fetch_s if model_dir is not None else None,
        )
        if any(r.status == "updated" for r in out.engines):
            self.counters.applied += 1
            self._prune_local(update.run)
        if not out.ok:
            self.counters.failed += 1
        if need or not out.ok:
            log.info(
                "sync round",
                version=update.version,
                ok=out.ok,
                fetch_s=out.fetch_s,
                engines=[f"{r.url}={r.status}" for r in out.engines],
            )
        self.last_result = out
        await self._record(out)
        return out

    async def _record(self, result: SyncResult) -> None:
        for r in result.engines:
            serving = str(result.version) if r.status == "updated" else r.before
            try:
                await record_engine(
                    self.js,
                    self.topology,
                    run=self.config.run,
                    url=r.url,
                    weight_version=serving,
                    status=r.status,
                    target_version=result.version,
                    message=r.message,
                )
            except (nats.errors.Error, nats.js.errors.Error) as exc:
                log.warning(
                    "engine version not recorded (live views only; syncing goes on)",
                    engine=r.url,
                    error=str(exc) or type(exc).__name__,
                )

    async def _weights_for(self, update: WeightUpdate) -> Path:
        """The verified directory to hand the engines for this version."""
        if update.version in self.counters.bad_versions:
            raise WeightVerificationError(
                f"version {update.version} already failed to fetch or verify; waiting for the next"
            )
        if update.version in self._ready:
            return self._ready[update.version]
        if update.format != "safetensors":
            raise WeightVerificationError(f"format {update.format!r} is not safetensors")
        local = self.config.directory / update.run / f"v{update.version}"
        if is_shared_path(update) and self.config.shared_path:
            await asyncio.to_thread(verify_file, update.object, update)
            file = Path(update.object)
        else:
            file = await self.store.fetch(update, local)
        directory = file.parent
        if await asyncio.to_thread(lora_config_of, file) is not None:  # a LoRA adapter
            directory = await asyncio.to_thread(adapter_directory, file, local / "lora")
        self._ready = {update.version: directory}
        return directory

    async def _reload(
        self,
        url: str,
        before: str | None,
        model_dir: Path | None,
        update: WeightUpdate,
    ) -> EngineResult:
        assert model_dir is not None
        started = time.perf_counter()
        version, timeout = str(update.version), self.config.update_timeout_s
        if (model_dir / "adapter_config.json").is_file():
            ok, message = await reload_engine(
                self.control,
                url,
                apply=lambda: load_adapter(
                    self.control, url, self.config.run, str(model_dir), version, timeout
                ),
                pause_mode=self.config.pause_mode,
            )
        else:
            ok, message = await reload_engine(
                self.control,
                url,
                model_path=str(model_dir),
                weight_version=version,
                pause_mode=self.config.pause_mode,
                update_timeout_s=timeout,
            )
        seconds = round(time.perf_counter() - started, 3)
        (log.info if ok else log.error)(
            "engine reloaded" if ok else "engine reload failed",
            engine=url,
            version=update.version,
            seconds=seconds,
            message=message,
        )
        return EngineResult(url, "updated" if ok else "failed", before, message, seconds)

    def _prune_local(self, run: str) -> None:
        run_dir = self.config.directory / run
        loaded = self._ready
        for version in local_versions(run_dir)[: -self.config.keep]:
            if version not in loaded:
                shutil.rmtree(run_dir / f"v{version}", ignore_errors=True)

    async def _engine_version(self, url: str) -> str | None:
        """The engine's ``weight_version``, or None when it cannot be read (then it is
        reloaded)."""
        try:
            return await self.control.weight_version(url)
        except EngineControlError as exc:
            log.warning("engine unreachable", engine=url, error=str(exc))
            return None


# ---- the engine's HTTP endpoints --------------------------------------------------------------


async def reload_engine(
    control: EngineControl,
    url: str,
    *,
    model_path: str = "",
    weight_version: str = "",
    pause_mode: str = "in_place",
    update_timeout_s: float = 600.0,
    apply: Callable[[], Awaitable[str]] | None = None,
) -> tuple[bool, str]:
    """pause → update_weights_from_disk (or ``apply()``: a LoRA adapter's calls) → continue on
    one engine: (updated, what happened), the one result a sync round records per engine.

    ``/continue_generation`` is always sent, even after a failed pause or update; a failed
    pause only means the update waits for requests in flight, as SGLang does without one.
    """
    notes: list[str] = []
    try:
        await control.pause(url, pause_mode)
    except EngineControlError as exc:
        notes.append(f"pause failed ({exc}); updated without it")
    try:
        if apply is not None:
            message = await apply()
        else:
            message = await control.update_weights_from_disk(
                url,
                model_path=model_path,
                weight_version=weight_version,
                timeout_s=update_timeout_s,
            )
        ok = True
        notes.insert(0, message)
    except EngineControlError as exc:
        ok = False
        # a refusal's own words, else what kept the call from an answer
        notes.insert(0, exc.message if exc.status in (200, 400) else f"update failed: {exc}")
    finally:
        try:
            # shielded: a syncer cancelled mid-update must still un-pause the engine
            await asyncio.shield(control.resume(url))
        except EngineControlError as exc:
            ok = False
            notes.append(f"continue_generation failed: {exc}")
    return ok, "; ".join(n for n in notes if n)


async def load_adapter(
    control: EngineControl, url: str, name: str, path: str, version: str, timeout_s: float
) -> str:
    """unload ``name`` (refused when none is loaded: fine) → load ``path`` as ``name`` → set the
    engine's weight_version to ``version``; the load's message."""
    with contextlib.suppress(EngineControlError):
        await control.unload_lora_adapter(url, name=name)
    message = await control.load_lora_adapter(url, name=name, path=path, timeout_s=timeout_s)
    await control.update_weight_version(url, version)
    return message


def _as_number(weight_version: str | None) -> int | None:
    if weight_version is None:
        return None
    try:
        return version_number(weight_version)
    except SchemaError:
        return None  # a version string we did not publish: reload to a known one
