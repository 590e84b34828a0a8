"""Engine weight versions: one KV entry per (run, engine), written by the weight syncer.

The syncer is the one process that asks engines their ``weight_version``; recording what it
saw lets anything on the wire (the dashboard) show which engine serves which version without
reaching the engines' HTTP ports. The key is ``<run>.<engine id>``, the id being 16 hex digits
of the URL's sha256 (a URL's ``:`` is not a key character); the JSON value carries the URL.
A running syncer rewrites its entries every ``--recheck-s``; the bucket's max age removes those
of engines nobody syncs any more.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Callable
from typing import Any

import nats.errors
from nats.js import JetStreamContext

from agentarium.broker import Topology, json_entries, put_entry
from agentarium.schemas import JSON, check_name, run_version


def engine_key(run: str, url: str) -> str:
    return f"{check_name(run, 'run')}.{hashlib.sha256(url.encode()).hexdigest()[:16]}"


async def record_engine(
    js: JetStreamContext,
    topo: Topology,
    *,
    run: str,
    url: str,
    weight_version: str | None,
    status: str,
    target_version: int,
    message: str = "",
    live: bool = True,
) -> None:
    """What one engine serves now (``weight_version`` None: it did not answer). ``live``
    False: the syncer that wrote it has stopped, so another run may take the engine over."""
    await js.key_value(topo.engines_bucket)  # BucketNotFoundError if missing
    value = {
        "run": run,
        "engine": url,
        "weight_version": weight_version,
        "target_version": target_version,
        "status": status,
        "message": message[:500],
        "live": live,
        "updated_at": time.time(),
    }
    await put_entry(
        js, topo.engines_bucket, engine_key(run, url), json.dumps(value).encode(), JSON.headers()
    )


async def engine_versions(js: JetStreamContext, topo: Topology) -> list[dict[str, Any]]:
    """Every recorded engine, sorted by run then URL."""
    out = await json_entries(js, topo.engines_bucket)
    return sorted(out, key=lambda e: (e.get("run", ""), e.get("engine", "")))


FRESH_S = 120.0  # an entry not rewritten for this long is an engine nobody syncs any more


def served_version(
    entries: list[dict[str, Any]], run: str, *, now: float, fresh_s: float = FRESH_S
) -> int | None:
    """The version every engine of ``run`` serves at least, from engines-KV entries: the lowest
    among entries written within ``fresh_s`` (a live syncer rewrites its engines every
    ``--recheck-s`` and after every round), each read from the engine's newest record by any
    run's syncer (one that took the engine over since wrote it). An engine counts as serving
    nothing (-1) when it did not answer (null), serves another run's weights or a label no
    trainer wrote (``schemas.run_version``: versions never compare across runs), or was found
    not to serve what it reports (status ``mismatch``). None when no such entry exists."""
    fresh = [e for e in entries if now - float(e.get("updated_at") or 0) <= fresh_s]
    newest: dict[str, dict[str, Any]] = {}  # engine URL -> its newest record, by any run
    for entry in fresh:
        url = str(entry.get("engine"))
        if url not in newest or entry.get("updated_at", 0) > newest[url].get("updated_at", 0):
            newest[url] = entry
    versions: list[int] = []
    for entry in fresh:
        if entry.get("run") != run:
            continue
        now_serving = newest[str(entry.get("engine"))]  # another run may have taken it since
        served = run_version(now_serving.get("weight_version"), run)
        if served is None or now_serving.get("status") == "mismatch":
            served = -1
        versions.append(served)
    return min(versions) if versions else None


async def wait_served(
    js: JetStreamContext,
    topo: Topology,
    run: str,
    version: int,
    *,
    fresh_s: float = FRESH_S,
    stop: asyncio.Event | None = None,
    timeout: float | None = None,
    on_wait: Callable[[float], None] | None = None,
    synced: bool = False,
) -> bool:
    """Wait until every engine of ``run`` serves ``version`` or newer of this run
    (``served_version``), by watching the engines KV. Version 0 is the base weights: without
    ``synced`` it needs a wait only while a syncer of the run records an engine serving
    something else (another run's weights, before this run's syncer took it over), and with no
    syncer recording the run's engines there is nothing to wait on; with ``synced`` (a syncer
    of the run is known to run: synchronous training, the demo) it waits for that syncer's
    record, so a run's first batch is never sampled from weights its syncer has not yet taken
    over. False when ``stop`` was set or ``timeout`` passed first; ``on_wait(waited_s)`` is
    called about every 30 s while waiting, for a warning."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    deadline = None if timeout is None else started + timeout
    kv = await js.key_value(topo.engines_bucket)
    watcher = await kv.watch(f"{check_name(run, 'run')}.*")
    entries: dict[str, dict[str, Any]] = {}
    initial_done = False  # the watch has delivered every entry that existed when it began
    next_warning = started + 30.0
    try:
        while True:
            served = served_version(list(entries.values()), run, now=time.time(), fresh_s=fresh_s)
            if served is not None and served >= version:
                return True
            if served is None and version <= 0 and initial_done and not synced:
                return True
            if stop is not None and stop.is_set():
                return False
            now = loop.time()
            if deadline is not None and now >= deadline:
                return False
            if on_wait is not None and now >= next_warning:
                on_wait(now - started)
                next_warning = now + 30.0
            # Wake at the next update, or after a second to look at stop, the deadline and the
            # entries' ages again.
            try:
                entry = await watcher.updates(timeout=1.0)
            except nats.errors.TimeoutError:
                continue
            if entry is None:  # the end of the initial values
                initial_done = True
                continue
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                entries.pop(entry.key, None)
            else:
                entries[entry.key] = json.loads(entry.value)
    finally:
        await watcher.stop()
