"""The weight syncer: keeps a fleet of engines on a run's latest policy version.

It runs beside the engines, sharing their filesystem (SGLang reads new weights from its own
disk). It watches the policy KV key ``<run>`` (the initial value included), and for each new
WeightUpdate:

1. asks every engine its ``/model_info`` ``weight_version``, the identity of what it serves
   (``schemas.WeightIdentity``: ``"default"`` for the base weights, ``"<run>@<version>:<sha16>"``
   for a published version), and leaves alone those serving this version, or a newer one *of
   this run*. An engine serving another run's weights (or a string no trainer wrote) is taken
   over: this run's weights are loaded (the base weights first, from the engine's original
   model directory, when this run has published nothing yet or trains a LoRA adapter), unless
   ``shared_engines`` is set, when the syncer stops with ``SyncRefused`` naming both runs; and
   never while another run's syncer records the engine as its own (a fresh engines-KV entry):
   that engine is left alone with an error each round (``conflict``), not fought over;
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
4. verifies each updated engine: its ``weight_version`` must be the identity just loaded, and
   for whole weights a read-back of a few parameters (``POST /get_weights_by_name``, SGLang's
   route, which the local engine serves too) must match the file within the rounding of a
   16-bit engine. A difference is status ``mismatch``: an error naming the engine and both
   identities, the metric ``agentarium_sync_mismatch_total``, and an engines-KV record whose
   status consumers read to hold the engine out of the run's fleet until a later round finds
   it serving the right weights;
5. keeps the newest ``keep`` local copies;
6. records what each engine serves now in the engines KV (``inference.record_engine``), for
   live views; a record that cannot be written is logged and skipped. On stop its records say
   ``live: false``, so another run may take the engines over at once.

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

from agentarium.broker import Backoff, BrokerError, Topology, cancel_and_wait, follow_key_value
from agentarium.schemas import SchemaError, WeightIdentity, WeightUpdate, decode

from ..control import EngineControl, EngineControlError
from ..engines import FRESH_S, engine_versions, record_engine
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
from .verify import read_back_mismatch, vllm_mismatch

log = structlog.get_logger("agentarium.sync")

WATCH_BACKOFF = Backoff(initial_s=0.5, max_s=10.0)  # re-creating a failed policy watch


class SyncRefused(BrokerError):
    """An engine serves another run's weights and this syncer may not take it over
    (``shared_engines``): the service stops with this message, which names both runs."""


@dataclass(frozen=True)
class EngineResult:
    """What happened to one engine for one version: ``updated``, ``skipped``, ``failed``,
    ``mismatch`` (updated, but it does not serve what was loaded) or ``conflict`` (another
    run's live syncer holds it: left alone)."""

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
    identity: str = "default"

    @property
    def ok(self) -> bool:
        return all(r.status in ("updated", "skipped") for r in self.engines)

    def __str__(self) -> str:
        lines = [f"version {self.version} ({self.identity}): " + ("ok" if self.ok else "FAILED")]
        for r in self.engines:
            lines.append(f"  {r.url}: {r.status} (was {r.before}) {r.message}".rstrip())
        return "\n".join(lines)


@dataclass
class SyncCounters:
    seen: int = 0
    applied: int = 0
    failed: int = 0
    mismatched: int = 0
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
                if self._stopping:
                    continue
                latest = self._latest
                if latest is not None and latest.version in self.counters.bad_versions:
                    continue  # reported once; wait for the next version
                try:
                    # nothing published yet: the run's version 0, the base weights
                    await self.apply(latest)
                except SyncRefused:
                    raise
                except Exception:  # one bad round must not end the service
                    log.exception(
                        "sync round failed", version=None if latest is None else latest.version
                    )
        finally:
            # not cancel-then-await: nats-py's watcher waits in 3.11's wait_for, which can
            # swallow a cancel (CPython gh-86296), and the await would never return
            await cancel_and_wait([watch])
            await self._release()
            await self.close()
            log.info("weight syncer stopped", syncer=repr(self))

    async def sync_once(self) -> SyncResult:
        """Apply the run's current version to every engine (the base weights, version 0, when
        nothing is published yet)."""
        update = await self.store.latest(self.config.run)
        if update is None:
            log.info(
                "nothing published yet: the run's engines serve the base weights",
                run=self.config.run,
            )
        else:
            self._offer(update)
        try:
            await self.apply(update)
            assert self.last_result is not None
            return self.last_result
        finally:
            await self._release()  # a one-off syncer holds no engine once it is done
            await self.close()

    async def _watch(self) -> None:
        """Feed ``_offer`` from a KV watch (re-created after any failure); poll when idle."""

        async def handle(kv, entry) -> None:
            if entry is None:  # the end of the initial values, or recheck_s idle: poll
                with contextlib.suppress(nats.js.errors.KeyNotFoundError):
                    entry = await kv.get(self.config.run)
            if entry is not None and entry.value:
                self._offer_bytes(entry.value)
            elif self._latest is None:
                # nothing published for this run: a round now (the base weights) rather
                # than after recheck_s
                self._wake.set()

        await follow_key_value(
            self.js,
            self.topology.policy_bucket,
            self.config.run,
            handle,
            what="policy",
            idle_s=self.config.recheck_s,
            backoff=WATCH_BACKOFF,
        )

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

    async def apply(self, update: WeightUpdate | None) -> SyncResult:
        """Bring every engine to ``update`` (None: the base weights, the run's version 0).

        Engines serving it, or a newer version of this run, are skipped; engines serving
        another run's weights are taken over (or, with ``shared_engines``, ``SyncRefused``)."""
        run = self.config.run
        target = WeightIdentity.base() if update is None else WeightIdentity.of(update)
        version = 0 if update is None else update.version
        infos = await asyncio.gather(*(self._engine_info(u) for u in self.config.engines))
        results: dict[str, EngineResult] = {}
        need: list[tuple[str, str | None, bool]] = []  # (url, serving, restore the base first)
        owners: dict[str, str] | None = None  # engine URL -> another run's live syncer
        for url, info in zip(self.config.engines, infos, strict=True):
            serving = None if info is None else _weight_version(info)
            held = WeightIdentity.parse(serving)
            if info is None:
                need.append((url, None, False))  # unreachable: the reload reports why
            elif held == target:
                results[url] = EngineResult(url, "skipped", serving, "already serving it")
            elif held is not None and held.run == run and held.version > version:
                results[url] = EngineResult(url, "skipped", serving, "serves a newer version")
                log.warning(
                    "engine is ahead of the published version of this run; left alone",
                    engine=url,
                    engine_version=serving,
                    version=version,
                )
            elif held is not None and (held.run == run or held.is_base):
                need.append((url, serving, False))
            else:  # another run's weights, or a label no trainer wrote
                other = held.run if held is not None else None
                if owners is None:
                    owners = await self._other_syncers()
                if url in owners:
                    message = (
                        f"engine serves {serving!r} and run {owners[url]!r}'s syncer is live on "
                        f"it: run {run!r} leaves it alone (stop that syncer, or give each run "
                        "its own engines)"
                    )
                    log.error("engine held by another run's syncer", engine=url, message=message)
                    results[url] = EngineResult(url, "conflict", serving, message)
                    continue
                if self.config.shared_engines:
                    raise SyncRefused(
                        f"engine {url} serves run {other or '?'!r}'s weights ({serving!r}); run "
                        f"{run!r} does not take it over (--shared-engines): give run {run!r} "
                        "engines of its own, or drop --shared-engines to take these over"
                    )
                log.warning(
                    "engine serves another run's weights: this run takes it over",
                    engine=url,
                    engine_version=serving,
                    other_run=other,
                    target=str(target),
                )
                need.append((url, serving, True))
        model_dir: Path | None = None
        fetch_s = 0.0
        if need and update is not None:
            started = time.perf_counter()
            try:
                model_dir = await self._weights_for(update)
            except WeightsError as exc:
                if isinstance(exc, WeightVerificationError | WeightNotFound):
                    self.counters.bad_versions.add(update.version)
                log.error("weights unavailable", version=update.version, error=str(exc))
                for url, serving, _ in need:
                    results[url] = EngineResult(url, "failed", serving, str(exc))
                need = []
            fetch_s = time.perf_counter() - started
        info_of = dict(zip(self.config.engines, infos, strict=True))
        reloads = await asyncio.gather(
            *(
                self._reload(url, serving, model_dir, target, base_first, info_of[url])
                for url, serving, base_first in need
            )
        )
        for result in reloads:
            results[result.url] = result
        out = SyncResult(
            version=version,
            engines=tuple(results[u] for u in self.config.engines),
            model_path=None if model_dir is None else str(model_dir),
            fetch_s=round(fetch_s, 3),
            identity=str(target),
        )
        record_sync_round(
            run,
            [
                (
                    r.url,
                    r.status,
                    r.seconds,
                    version if r.status == "updated" else _run_version(r.before, run),
                )
                for r in out.engines
            ],
            fetch_s if model_dir is not None else None,
        )
        if any(r.status == "updated" for r in out.engines):
            self.counters.applied += 1
            self._prune_local(run)
        self.counters.mismatched += sum(r.status == "mismatch" for r in out.engines)
        if not out.ok:
            self.counters.failed += 1
        if need or not out.ok:
            log.info(
                "sync round",
                version=version,
                identity=str(target),
                ok=out.ok,
                fetch_s=out.fetch_s,
                engines=[f"{r.url}={r.status}" for r in out.engines],
            )
        self.last_result = out
        await self._record(out)
        return out

    async def _other_syncers(self) -> dict[str, str]:
        """Engine URL -> run, for engines another run's syncer recorded within ``FRESH_S`` and
        has not released (``live`` false): a live syncer that would load its weights back."""
        try:
            entries = await engine_versions(self.js, self.topology)
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning("engines KV unreadable; other runs' syncers not checked", error=str(exc))
            return {}
        now = time.time()
        return {
            str(e.get("engine")): str(e.get("run"))
            for e in entries
            if e.get("run") != self.config.run
            and e.get("live", True)
            and now - float(e.get("updated_at") or 0) <= FRESH_S
        }

    async def _record(self, result: SyncResult) -> None:
        for r in result.engines:
            serving = result.identity if r.status == "updated" else r.before
            await self._record_engine(r.url, serving, r.status, result.version, r.message)

    async def _record_engine(
        self,
        url: str,
        serving: str | None,
        status: str,
        version: int,
        message: str,
        *,
        live: bool = True,
    ) -> None:
        try:
            await record_engine(
                self.js,
                self.topology,
                run=self.config.run,
                url=url,
                weight_version=serving,
                status=status,
                target_version=version,
                message=message,
                live=live,
            )
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            log.warning(
                "engine version not recorded (live views only; syncing goes on)",
                engine=url,
                error=str(exc) or type(exc).__name__,
            )

    async def _release(self) -> None:
        """On stop: rewrite this syncer's records with ``live`` false (what each engine
        serves stays), so another run may take the engines over at once; a syncer that died
        instead is taken over once its records are ``FRESH_S`` old."""
        last = self.last_result
        if last is None:
            return
        for r in last.engines:
            serving = last.identity if r.status == "updated" else r.before
            await self._record_engine(r.url, serving, r.status, last.version, r.message, live=False)

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
        target: WeightIdentity,
        base_first: bool,
        info: dict | None,
    ) -> EngineResult:
        started = time.perf_counter()
        identity, timeout = str(target), self.config.update_timeout_s
        adapter = model_dir is not None and (model_dir / "adapter_config.json").is_file()
        restore = target.is_base or (adapter and base_first)
        base = self._base_directory(info) if restore else None
        if restore and base is None:
            message = (
                "cannot restore the base weights: the engine's /model_info names no model "
                "directory on this disk holding *.safetensors; give --base-model DIR"
            )
            log.error("engine reload failed", engine=url, target=identity, message=message)
            return EngineResult(url, "failed", before, message)

        async def apply() -> str:
            notes = []
            if base is not None:
                notes.append(
                    await self.control.update_weights_from_disk(
                        url,
                        model_path=str(base),
                        weight_version=str(WeightIdentity.base()),
                        timeout_s=timeout,
                    )
                )
            if adapter:
                assert model_dir is not None
                notes.append(
                    await load_adapter(
                        self.control, url, self.config.run, str(model_dir), identity, timeout
                    )
                )
            elif model_dir is not None:
                notes.append(
                    await self.control.update_weights_from_disk(
                        url, model_path=str(model_dir), weight_version=identity, timeout_s=timeout
                    )
                )
            return "; ".join(n for n in notes if n)

        ok, message = await reload_engine(
            self.control, url, apply=apply, pause_mode=self.config.pause_mode
        )
        status = "updated" if ok else "failed"
        verify_s = 0.0
        if ok:
            checking = time.perf_counter()
            problem = await self._verify(url, target, None if adapter else model_dir)
            verify_s = round(time.perf_counter() - checking, 3)
            if problem:
                status, message = "mismatch", problem
        seconds = round(time.perf_counter() - started, 3)
        if status == "mismatch":
            log.error(
                "engine does not serve the weights just loaded: out of the run's fleet until "
                "it does",
                engine=url,
                expected=identity,
                message=message,
            )
        else:
            (log.info if ok else log.error)(
                "engine reloaded" if ok else "engine reload failed",
                engine=url,
                identity=identity,
                seconds=seconds,
                verify_s=verify_s,
                message=message,
            )
        return EngineResult(url, status, before, message, seconds)

    async def _verify(self, url: str, target: WeightIdentity, model_dir: Path | None) -> str:
        """ "" when ``url`` serves ``target``, else what differs: its ``weight_version``, then
        (whole weights only) a read-back of a few parameters against the file."""
        try:
            served = await self.control.weight_version(url)
        except EngineControlError as exc:
            return f"weights not verified: {exc}"
        if served != str(target):
            return f"serves {served!r} after loading {str(target)!r}"
        if model_dir is None:
            return ""
        if await self.control.kind(url) == "vllm":
            base = self._base_directory(await self._engine_info(url))  # the probe's model
            return await vllm_mismatch(self.control, url, model_dir, base, target)
        return await read_back_mismatch(self.control, url, model_dir, target)

    def _base_directory(self, info: dict | None) -> Path | None:
        """The engine's original weights on this disk: ``--base-model``, else its
        ``/model_info`` ``tokenizer_path`` (where the engine was started from; SGLang changes
        ``model_path`` with every update) when that holds *.safetensors."""
        if self.config.base_model is not None:
            return self.config.base_model
        path = (info or {}).get("tokenizer_path")
        if isinstance(path, str) and path:
            directory = Path(path)
            if directory.is_dir() and any(directory.glob("*.safetensors")):
                return directory
        return None

    def _prune_local(self, run: str) -> None:
        run_dir = self.config.directory / run
        loaded = self._ready
        for version in local_versions(run_dir)[: -self.config.keep]:
            if version not in loaded:
                shutil.rmtree(run_dir / f"v{version}", ignore_errors=True)

    async def _engine_info(self, url: str) -> dict | None:
        """The engine's ``/model_info``, or None when it cannot be read (then a reload is
        tried, which says why it failed)."""
        try:
            return await self.control.model_info(url)
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


def _weight_version(info: dict) -> str | None:
    version = info.get("weight_version")
    return None if version is None else str(version)


def _run_version(weight_version: str | None, run: str) -> int | None:
    """The engine's version as one of ``run``'s, for the version gauge (None: not the run's)."""
    identity = WeightIdentity.parse(weight_version)
    return None if identity is None else identity.version_in(run)
