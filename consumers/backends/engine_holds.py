"""Engines held out of a consumer's fleet while their weight syncer finds them serving other
weights than they report.

The syncer (``agentarium sync``) verifies every engine after an update and records a failed
verification in the engines KV as status ``mismatch`` (docs/design.md "Weight flow"). A
consumer watches that bucket and holds such an engine out of its fleet (its breaker opens:
no rollout is sent to it, so no trajectory is stamped with weights it did not serve) until a
later record of the same run says otherwise. Engines are matched by URL, as given to the
syncer's ``--engine`` and the consumer's backend (a trailing ``/`` ignored). Records older
than ``inference.FRESH_S`` (nobody syncs that engine any more) lift the hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext

from agentarium.broker import Backoff, Topology
from agentarium.inference import FRESH_S

if TYPE_CHECKING:
    from ..fleet import Fleet

log = structlog.get_logger("agentarium.consumers")

RETRY = Backoff(initial_s=0.5, max_s=10.0)


def held_out(entries: Sequence[dict[str, Any]], *, now: float) -> dict[str, str]:
    """URL -> why, for engines whose fresh record says ``mismatch``; an engine recorded by
    several runs' syncers is held out when any fresh one says so."""
    out: dict[str, str] = {}
    for e in entries:
        if e.get("status") != "mismatch" or now - float(e.get("updated_at") or 0) > FRESH_S:
            continue
        url = str(e.get("engine") or "").rstrip("/")
        out[url] = f"run {e.get('run')!r}'s syncer: {e.get('message') or 'weights mismatch'}"
    return out


def apply_holds(fleets: Sequence[Fleet], holds: dict[str, str]) -> None:
    for fleet in fleets:
        for url in fleet.servers:
            why = holds.get(url.rstrip("/"))
            if why is not None:
                fleet.quarantine(url, why)
            else:
                fleet.unquarantine(url)


async def watch_engine_records(
    js: JetStreamContext, topology: Topology, fleets: Sequence[Fleet]
) -> None:
    """Until cancelled: keep ``fleets``' quarantines in step with the engines KV (a watch,
    re-created after any failure; ages re-checked every second)."""
    failures = 0
    while True:
        watcher = None
        entries: dict[str, dict[str, Any]] = {}
        try:
            kv = await js.key_value(topology.engines_bucket)
            watcher = await kv.watch(">")
            failures = 0
            while True:
                try:
                    entry = await watcher.updates(timeout=1.0)
                except nats.errors.TimeoutError:
                    entry = None
                if entry is not None:
                    if entry.operation in ("DEL", "PURGE") or not entry.value:
                        entries.pop(entry.key, None)
                    else:
                        with contextlib.suppress(ValueError):
                            entries[entry.key] = json.loads(entry.value)
                apply_holds(fleets, held_out(list(entries.values()), now=time.time()))
        except asyncio.CancelledError:
            raise
        except nats.js.errors.BucketNotFoundError:
            await asyncio.sleep(RETRY.max_s)  # not provisioned (yet): nobody records engines
        except Exception as exc:
            failures += 1
            wait = RETRY.delay(failures)
            log.warning(
                "engines KV watch failed; retrying",
                error=str(exc) or type(exc).__name__,
                retry_in_s=round(wait, 3),
            )
            await asyncio.sleep(wait)
        finally:
            if watcher is not None:
                with contextlib.suppress(Exception):
                    await watcher.stop()
