"""The live-workers registry: one KV entry per worker, expired by the bucket's TTL.

nats-server 2.9 ignores per-message TTLs, so liveness is the bucket-level ``max_age``:
a worker that stops refreshing its entry disappears after ``workers_ttl_s``.
"""

from __future__ import annotations

import json
import time
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext

from .topology import Topology


async def publish_worker(
    js: JetStreamContext, topo: Topology, worker_id: str, info: dict[str, Any]
) -> None:
    kv = await js.key_value(topo.workers_bucket)
    await kv.put(
        worker_id, json.dumps({**info, "worker_id": worker_id, "updated_at": time.time()}).encode()
    )


async def remove_worker(js: JetStreamContext, topo: Topology, worker_id: str) -> None:
    """Best effort, on shutdown: a broker that does not answer (restarting, electing a leader,
    unreachable) costs nothing, since the bucket's TTL removes the entry anyway; it must not
    turn a worker's clean stop into a crash."""
    try:
        kv = await js.key_value(topo.workers_bucket)
        await kv.delete(worker_id)
    except (nats.errors.Error, OSError):  # JetStream errors, timeouts, a closed connection
        pass


async def json_entries(js: JetStreamContext, bucket: str) -> list[dict[str, Any]]:
    """Every live entry of a KV bucket whose values are JSON objects (the workers registry,
    the engines' versions); an entry that expires between listing and reading is skipped."""
    kv = await js.key_value(bucket)
    try:
        keys = await kv.keys()
    except nats.js.errors.NoKeysError:
        return []
    out = []
    for key in keys:
        try:
            entry = await kv.get(key)
        except nats.js.errors.KeyNotFoundError:
            continue
        if entry.value:
            out.append(json.loads(entry.value))
    return out


async def live_workers(js: JetStreamContext, topo: Topology) -> list[dict[str, Any]]:
    workers = await json_entries(js, topo.workers_bucket)
    return sorted(workers, key=lambda w: w.get("worker_id", ""))
