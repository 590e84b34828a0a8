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

import contextlib
import json
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import structlog
from nats.js import JetStreamContext

from agentarium.broker import Backoff, Topology, follow_key_value
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
    """Until cancelled: keep ``fleets``' holds in step with the engines KV (a watch, re-created
    after any failure; the records' ages looked at again every second)."""
    entries: dict[str, dict[str, Any]] = {}

    async def handle(kv, entry) -> None:
        if entry is not None:
            if entry.operation in ("DEL", "PURGE") or not entry.value:
                entries.pop(entry.key, None)
            else:
                with contextlib.suppress(ValueError):
                    entries[entry.key] = json.loads(entry.value)
        apply_holds(fleets, held_out(list(entries.values()), now=time.time()))

    await follow_key_value(
        js, topology.engines_bucket, ">", handle, what="engines KV", idle_s=1.0, backoff=RETRY
    )
