"""Engine weight versions: one KV entry per (run, engine), written by the weight syncer.

The syncer is the one process that asks engines their ``weight_version``; recording what it
saw lets anything on the wire (the dashboard) show which engine serves which version without
reaching the engines' HTTP ports. The key is ``<run>.<engine id>``, the id being 16 hex digits
of the URL's sha256 (a URL's ``:`` is not a key character); the JSON value carries the URL.
A running syncer rewrites its entries every ``--recheck-s``; the bucket's max age removes those
of engines nobody syncs any more.
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from nats.js import JetStreamContext

from schemas import check_name

from .registry import json_entries
from .topology import Topology


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
) -> None:
    """What one engine serves now (``weight_version`` None: it did not answer)."""
    kv = await js.key_value(topo.engines_bucket)
    value = {
        "run": run,
        "engine": url,
        "weight_version": weight_version,
        "target_version": target_version,
        "status": status,
        "message": message[:500],
        "updated_at": time.time(),
    }
    await kv.put(engine_key(run, url), json.dumps(value).encode())


async def engine_versions(js: JetStreamContext, topo: Topology) -> list[dict[str, Any]]:
    """Every recorded engine, sorted by run then URL."""
    out = await json_entries(js, topo.engines_bucket)
    return sorted(out, key=lambda e: (e.get("run", ""), e.get("engine", "")))
