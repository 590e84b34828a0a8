"""Weights streamed from the trainer to the engines over torch.distributed, without a file.

The trainer is rank 0 of a process group that the engines join through SGLang's own endpoints
(the local engine serves the same ones), so only the trainer process, which holds the tensors,
can drive it. For each version, ``WeightStreamer.stream``:

1. asks every engine ``/model_info``: an engine that does not answer is left out of this
   version; one whose ``engine_id`` (the local engine's) or ``weight_version`` is not what the
   streamer last saw there has restarted or been updated by someone else;
2. (re)builds the group when there is none, the last update failed, the set of engines changed
   or one restarted: ``/destroy_weights_update_group`` to every engine (a predecessor's group of
   the same name included), a TCPStore on a free port, then ``/init_weights_update_group``
   (``master_address``, ``master_port``, ``rank_offset``, ``world_size``, ``group_name``,
   ``backend``) to every engine *while* this process joins as rank 0 (the joins wait for each
   other: one after the other would deadlock). An engine takes ``tp_size`` ranks (SGLang's
   ``/server_info``; one for the local engine);
3. ``/pause_generation`` (``in_place``) → ``/update_weights_from_distributed`` (``names``,
   ``dtypes``, ``shapes``, ``group_name``, ``weight_version``, ``flush_cache``,
   ``abort_all_requests``) to every engine while broadcasting each tensor from rank 0 →
   ``/continue_generation``, sent whatever happened, as the syncer's reload does;
4. a broadcast that fails or times out (``timeout_s``) ends the update: the group is dropped
   at once, so engines still receiving fail instead of waiting, and rebuilt next version. An
   engine answers success only once every tensor arrived and was swapped in; any other engine
   keeps its weights (none is half-updated) and is left to the object store.

``StreamPublisher`` is the trainer loop's publisher in ``stream`` mode: it streams, then stores
the version as the default path does (object store, or shared path) and writes the
WeightUpdate to the policy KV, so consumers see the version and ``agentarium sync`` brings any
engine the stream missed (it stalled, restarted, or was left out) to it from the store.
"""

from __future__ import annotations

import asyncio
import socket
import tempfile
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import structlog

from agentarium.broker import Topology, is_loopback
from agentarium.inference import EngineControl, EngineControlError, record_engine, sha256_file
from agentarium.schemas import WeightIdentity, WeightUpdate, check_name

if TYPE_CHECKING:
    from nats.js import JetStreamContext

    from .config import TrainerConfig
    from .weights import RunPublisher

log = structlog.get_logger("agentarium.weights")

BACKENDS = ("gloo", "nccl")
WEIGHT_TRANSPORTS = ("object-store", "shared-path", "stream")  # the trainer's --weight-transport
CONTROL_TIMEOUT_S = 10.0  # probe, pause, continue, destroy


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """The engines a trainer streams to, and how."""

    engines: tuple[str, ...]
    master_address: str | None = None  # how engines reach this process; default: see address()
    backend: str = "gloo"
    timeout_s: float = 60.0  # joining the group, and each broadcast
    pause_mode: str = "in_place"
    bucket: bool = False  # one flattened uint8 buffer per update instead of one per tensor

    def __post_init__(self) -> None:
        if not self.engines:
            raise ValueError("streaming needs at least one --stream-engine URL")
        for url in self.engines:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} needs http:// or https://")
        if len(set(self.engines)) != len(self.engines):
            raise ValueError("an engine URL is given twice")
        if self.backend not in BACKENDS:
            raise ValueError(f"stream backend must be one of {', '.join(BACKENDS)}")
        if self.timeout_s <= 0:
            raise ValueError("the stream timeout must be positive")

    def address(self) -> str:
        """``master_address``, else 127.0.0.1 when every engine is on this machine, else this
        machine's address on the route to the first engine."""
        if self.master_address:
            return self.master_address
        hosts = [urlsplit(url).hostname or "" for url in self.engines]
        if all(is_loopback(host) for host in hosts):
            return "127.0.0.1"
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((next(h for h in hosts if not is_loopback(h)), 9))  # sends nothing
            return probe.getsockname()[0]


@dataclass(frozen=True)
class EngineStream:
    """What happened to one engine for one version: ``updated`` or ``failed``."""

    url: str
    status: str
    before: str | None
    message: str = ""


@dataclass(frozen=True)
class StreamResult:
    version: int
    engines: tuple[EngineStream, ...]
    seconds: float  # probe, (re)build, pause, broadcast and swap, continue
    rebuilt: bool
    broadcast_s: float = 0.0  # rank 0's broadcast alone

    @property
    def ok(self) -> bool:
        return all(e.status == "updated" for e in self.engines)

    def failed(self) -> list[str]:
        return [e.url for e in self.engines if e.status != "updated"]


@dataclass
class _Member:
    url: str
    rank_offset: int
    ranks: int
    engine_id: str | None
    version: str | None  # what the engine serves, as far as the streamer knows


@dataclass
class _Probe:
    url: str
    ok: bool
    engine_id: str | None = None
    version: str | None = None
    message: str = ""


@dataclass
class StreamCounters:
    """What a streamer's weight broadcasts came to: streamed, failed, group rebuilds, bytes."""

    streamed: int = 0
    failed: int = 0
    rebuilt: int = 0
    bytes: int = 0
    last: StreamResult | None = field(default=None, repr=False)


class WeightStreamer:
    """Rank 0 of the engines' weight-update group for one run (see the module docstring)."""

    def __init__(self, config: StreamConfig, *, run: str) -> None:
        self.config = config
        self.run = check_name(run, "run")
        self.group_name = f"agentarium-{self.run}"
        self.counters = StreamCounters()
        self._pg: Any = None
        self._store: Any = None
        self._members: dict[str, _Member] = {}
        self._broken = False
        self._broadcast_s = 0.0
        # the engines' control API; a call is bounded by a broadcast's timeout too
        self.control = EngineControl(timeout_s=min(CONTROL_TIMEOUT_S, 2 * config.timeout_s))

    def __repr__(self) -> str:
        c = self.counters
        return (
            f"<WeightStreamer {self.group_name} engines={len(self.config.engines)} "
            f"members={len(self._members)} streamed={c.streamed} failed={c.failed} "
            f"rebuilt={c.rebuilt}>"
        )

    async def close(self) -> None:
        """Leave the group (the engines too) and close the HTTP session."""
        if self._pg is not None or self._members:
            await self._drop_group(tell=list(self._members))
        await self.control.close()

    # ---- one version -------------------------------------------------------------------------

    async def stream(
        self, tensors: list[tuple[str, Any]], version: int, identity: str | None = None
    ) -> StreamResult:
        """Bring every engine that answers to ``version`` by broadcasting ``tensors`` (name,
        tensor) from rank 0; engines then report ``identity`` (the version's
        ``WeightIdentity``, ``str(version)`` when not given) as their ``weight_version``.
        Never raises for an engine's failure: see the result."""
        started = time.perf_counter()
        probes = await asyncio.gather(*(self._probe(url) for url in self.config.engines))
        reachable = [p for p in probes if p.ok]
        results = {
            p.url: EngineStream(p.url, "failed", None, f"not reachable: {p.message}")
            for p in probes
            if not p.ok
        }
        rebuilt = False
        self._broadcast_s = 0.0
        if reachable and self._needs_rebuild(reachable):
            error = await self._rebuild(reachable)
            rebuilt = True
            if error:
                for p in reachable:
                    results[p.url] = EngineStream(p.url, "failed", p.version, error)
                reachable = []
        if reachable:
            updated = await self._update(
                tensors, identity or str(version), {p.url: p for p in reachable}
            )
            results.update(updated)
        out = StreamResult(
            version=version,
            engines=tuple(results[url] for url in self.config.engines),
            seconds=round(time.perf_counter() - started, 3),
            rebuilt=rebuilt,
            broadcast_s=round(self._broadcast_s, 3),
        )
        self.counters.streamed += 1
        self.counters.last = out
        if not out.ok:
            self.counters.failed += 1
        (log.info if out.ok else log.warning)(
            "weights streamed" if out.ok else "weights not streamed to every engine",
            version=version,
            seconds=out.seconds,
            broadcast_s=out.broadcast_s,
            rebuilt=rebuilt,
            engines=[f"{e.url}={e.status}" for e in out.engines],
            errors=[e.message for e in out.engines if e.status != "updated"] or None,
        )
        return out

    def _needs_rebuild(self, reachable: list[_Probe]) -> bool:
        if self._pg is None or self._broken:
            return True
        if {p.url for p in reachable} != set(self._members):
            return True
        for p in reachable:
            member = self._members[p.url]
            if p.engine_id != member.engine_id or p.version != member.version:
                log.info(
                    "engine changed since the last update: rebuilding the weight group",
                    engine=p.url,
                    engine_id=p.engine_id,
                    version=p.version,
                    expected_version=member.version,
                )
                return True
        return False

    async def _update(
        self, tensors: list[tuple[str, Any]], identity: str, probes: dict[str, _Probe]
    ) -> dict[str, EngineStream]:
        from . import weight_group as wg

        cfg = self.config
        members = list(self._members.values())
        names = [name for name, _ in tensors]
        dtypes = [wg.dtype_name(t.dtype) for _, t in tensors]
        shapes = [list(t.shape) for _, t in tensors]
        notes: dict[str, list[str]] = {m.url: [] for m in members}
        paused = await _settled(self.control.pause(m.url, cfg.pause_mode) for m in members)
        for m, refusal in zip(members, paused, strict=True):
            if refusal is not None:
                notes[m.url].append(f"pause failed ({refusal}); updated without it")
        answers: dict[str, str | EngineControlError] = {}
        try:
            posts = {
                m.url: asyncio.create_task(
                    # no total timeout: a large model may take longer than one broadcast's
                    # timeout_s; the answers are awaited for a grace period once it ended
                    self.control.update_weights_from_distributed(
                        m.url,
                        names=names,
                        dtypes=dtypes,
                        shapes=shapes,
                        group_name=self.group_name,
                        weight_version=identity,
                        load_format="flattened_bucket" if cfg.bucket else None,
                        timeout_s=None,
                    )
                )
                for m in members
            }
            data = [t for _, t in tensors]
            sending = time.perf_counter()
            try:
                if cfg.bucket:
                    await asyncio.to_thread(wg.broadcast_bucket, self._pg, data)
                else:
                    await asyncio.to_thread(wg.broadcast, self._pg, data)
                grace = 2 * cfg.timeout_s
                self._broadcast_s = time.perf_counter() - sending
                self.counters.bytes += sum(t.numel() * t.element_size() for t in data)
            except Exception as exc:  # gloo/NCCL errors and timeouts: DistBackendError etc.
                error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.warning("weight broadcast failed; dropping the group", error=error)
                for m in members:
                    notes[m.url].append(f"broadcast failed: {error}")
                # engines still receiving fail once our end is gone, rather than time out
                await self._drop_group(tell=[])
                grace = min(CONTROL_TIMEOUT_S, cfg.timeout_s)
            done, _ = await asyncio.wait(posts.values(), timeout=grace)
            for url, task in posts.items():
                if task in done:
                    answers[url] = _answer(task)
                else:
                    task.cancel()
                    answers[url] = EngineControlError(
                        url, "/update_weights_from_distributed", "no answer", status=None
                    )
        finally:
            # shielded: a cancelled publish must still un-pause the engines
            resumed = await asyncio.shield(_settled(self.control.resume(m.url) for m in members))
        out: dict[str, EngineStream] = {}
        for m, refusal in zip(members, resumed, strict=True):
            if refusal is not None:
                notes[m.url].append(f"continue_generation failed: {refusal}")
            answer = answers[m.url]
            success = refusal is None and not isinstance(answer, EngineControlError)
            note = "; ".join(n for n in (str(answer), *notes[m.url]) if n)
            before = probes[m.url].version
            out[m.url] = EngineStream(m.url, "updated" if success else "failed", before, note)
            m.version = identity if success else None
            if not success:
                self._broken = True
        return out

    # ---- the group -------------------------------------------------------------------------

    async def _rebuild(self, probes: list[_Probe]) -> str:
        """Drop the old group and make a new one with these engines; "" or what failed."""
        from . import weight_group as wg

        cfg = self.config
        # tell every engine that answered, a predecessor's group of this name included; one
        # that did not answer is told when it is back, before it joins again
        self._members = {}
        await self._drop_group(tell=[p.url for p in probes])
        ranks = await asyncio.gather(*(self.control.ranks(p.url) for p in probes))
        world_size = 1 + sum(ranks)
        members, offset = {}, 1
        for p, n in zip(probes, ranks, strict=True):
            members[p.url] = _Member(p.url, offset, n, p.engine_id, p.version)
            offset += n
        store = await asyncio.to_thread(wg.master_store, world_size, cfg.timeout_s)
        address = cfg.address()
        started = time.perf_counter()
        joining = asyncio.create_task(
            asyncio.to_thread(
                wg.create_group,
                store,
                world_size=world_size,
                group_name=self.group_name,
                backend=cfg.backend,
                timeout_s=cfg.timeout_s,
            )
        )
        refusals = await _settled(
            self.control.init_weights_update_group(
                m.url,
                master_address=address,
                master_port=store.port,
                rank_offset=m.rank_offset,
                world_size=world_size,
                group_name=self.group_name,
                backend=cfg.backend,
                timeout_s=2 * cfg.timeout_s,
            )
            for m in members.values()
        )
        refused = [
            f"{u}: {error}" for u, error in zip(members, refusals, strict=True) if error is not None
        ]
        try:
            pg = await joining
        except Exception as exc:
            error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            joined = [u for u, e in zip(members, refusals, strict=True) if e is None]
            await self._tell_destroy(joined)
            return f"weight group not built ({error}); " + "; ".join(refused)
        self._pg, self._store = pg, store
        self._members = members
        self._broken = False
        self.counters.rebuilt += 1
        log.info(
            "weight group built",
            group=self.group_name,
            world_size=world_size,
            master=f"{address}:{store.port}",
            backend=cfg.backend,
            engines=list(members),
            seconds=round(time.perf_counter() - started, 3),
        )
        if refused:  # joined our side yet answered failure: do not trust the group
            self._broken = True
            return "; ".join(refused)
        return ""

    async def _drop_group(self, *, tell: list[str]) -> None:
        from . import weight_group as wg

        pg, self._pg, self._store = self._pg, None, None
        self._broken = True
        if pg is not None:
            await asyncio.to_thread(wg.destroy_group, pg)
        if tell:
            await self._tell_destroy(tell)
        for url in tell:
            self._members.pop(url, None)

    async def _tell_destroy(self, urls: list[str]) -> None:
        # an engine that is not in the group, or gone, has nothing to leave
        await _settled(
            self.control.destroy_weights_update_group(url, self.group_name) for url in urls
        )

    # ---- HTTP ------------------------------------------------------------------------------

    async def _probe(self, url: str) -> _Probe:
        try:
            info = await self.control.model_info(url)
        except EngineControlError as exc:
            return _Probe(url, False, message=str(exc))
        version = info.get("weight_version")
        engine_id = info.get("engine_id")
        return _Probe(
            url,
            True,
            engine_id=None if engine_id is None else str(engine_id),
            version=None if version is None else str(version),
        )


async def _settled(calls: Iterable[Awaitable[Any]]) -> list[EngineControlError | None]:
    """Run the control calls together: per call, None or the EngineControlError it raised
    (one engine's failure is a note on its result; any other error propagates)."""
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, EngineControlError):
            raise result
    return [r if isinstance(r, EngineControlError) else None for r in results]


def _answer(task: asyncio.Task) -> str | EngineControlError:
    """A finished weight call: the engine's message, or the EngineControlError it raised."""
    error = task.exception()
    if error is None:
        return str(task.result())
    if isinstance(error, EngineControlError):
        return error
    raise error


class StreamPublisher:
    """The trainer loop's publisher in ``stream`` mode: stream the version to the engines,
    then store it through ``store`` (object store or shared path) and write the WeightUpdate,
    which is what the loop awaits and what the syncer falls back on."""

    def __init__(
        self,
        streamer: WeightStreamer,
        store: RunPublisher,
        *,
        js: JetStreamContext | None = None,
        topology: Topology | None = None,
    ) -> None:
        self.streamer = streamer
        self.store = store
        self.js = js
        self.topology = topology or Topology()
        self.last: StreamResult | None = None

    def __repr__(self) -> str:
        return f"<StreamPublisher {self.streamer!r} then {self.store!r}>"

    async def publish(self, model: Any, version: int, step: int) -> WeightUpdate:
        """Save the version's file first, for its sha256: the identity engines report
        (``run@version:checksum``) names the same file whether the stream or the syncer
        delivered it; then stream, then store that file."""
        from . import weight_group as wg
        from .weights import materialize

        device = "cpu" if self.streamer.config.backend == "gloo" else None
        tensors = await asyncio.to_thread(wg.streamable, model, device=device)
        with tempfile.TemporaryDirectory(prefix="agentarium-stream-") as tmp:
            file, _ = await asyncio.to_thread(materialize, model, Path(tmp))
            sha, _size = await asyncio.to_thread(sha256_file, file)
            identity = WeightIdentity.named(self.streamer.run, version, sha)
            self.last = await self.streamer.stream(tensors, version, str(identity))
            update = await self.store.publish(file, version, step)
        if WeightIdentity.of(update) != identity:  # the store hashed the very same file
            raise RuntimeError(f"stored {WeightIdentity.of(update)}, streamed {identity}")
        await self._record(self.last, str(identity))
        return update

    async def latest_version(self) -> int | None:
        return await self.store.latest_version()

    async def close(self) -> None:
        await self.streamer.close()

    async def _record(self, result: StreamResult, identity: str) -> None:
        if self.js is None:
            return
        for e in result.engines:
            try:
                await record_engine(
                    self.js,
                    self.topology,
                    run=self.streamer.run,
                    url=e.url,
                    weight_version=identity if e.status == "updated" else e.before,
                    status=e.status,
                    target_version=result.version,
                    message=("streamed" if e.status == "updated" else e.message),
                )
            except Exception as exc:  # live views only
                log.warning("engine version not recorded", engine=e.url, error=str(exc))


def stream_publisher(
    config: StreamConfig, weights_dir: Any = None, keep_versions: int | None = None
):
    """A PublisherFactory (trainer.run_trainer's make_publisher) for ``stream`` mode; the
    store behind it is the object store, or the shared path under ``weights_dir``."""

    def make(js: JetStreamContext, topology: Topology, trainer_config: TrainerConfig):
        from .weights import WeightStore

        kwargs = {} if keep_versions is None else {"keep_versions": keep_versions}
        store = WeightStore(js, topology, weights_dir=weights_dir, **kwargs)
        streamer = WeightStreamer(config, run=trainer_config.run)
        return StreamPublisher(
            streamer, store.for_run(trainer_config.run), js=js, topology=topology
        )

    return make
