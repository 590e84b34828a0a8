"""The live-workers registry: one KV entry per worker, gone when the worker stops refreshing it.

On nats-server 2.11+ each entry carries its own TTL (``Nats-TTL``, ``ENTRY_TTL_S`` unless
the worker says otherwise), so a worker that died disappears after three missed refreshes.
Older servers have no per-message TTL (2.9 ignores the header): there the bucket-level
``max_age`` (``Limits.workers_ttl_s``, 30 s) expires it. The bucket's ``max_age`` stays the
backstop on every version.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import RawStreamMsg

from agentarium.schemas import JSON

from .kvput import put_entry
from .topology import Topology
from .version import MSG_TTL_SINCE, js_server_version

# Three refreshes of a worker's default 5 s interval: one lost refresh never hides a worker.
ENTRY_TTL_S = 15.0

# How a KV bucket marks a removed key (nats-py's nats.js.kv spells these privately).
KV_OP = "KV-Operation"
KV_DEL = "DEL"
KV_PURGE = "PURGE"
KV_MARKER_REASON = "Nats-Marker-Reason"  # 2.11+: the server's own markers (TTL, max age)


async def entry_ttl_supported(js: JetStreamContext, topo: Topology) -> bool:
    """Whether the workers bucket takes per-entry TTLs: a 2.11+ server and a stream created
    (or updated by ``broker init``) with ``allow_msg_ttl``."""
    if js_server_version(js) < MSG_TTL_SINCE:
        return False
    info = await js.stream_info(f"KV_{topo.workers_bucket}")
    return bool(info.config.allow_msg_ttl)


async def publish_worker(
    js: JetStreamContext,
    topo: Topology,
    worker_id: str,
    info: dict[str, Any],
    *,
    ttl_s: float | None = None,
) -> None:
    """Write (or refresh) the worker's entry. ``ttl_s``: how long it lives unless refreshed
    (default ``ENTRY_TTL_S``; pass about three refresh intervals), where the server has
    per-entry TTLs; elsewhere the bucket's TTL applies."""
    payload = json.dumps({**info, "worker_id": worker_id, "updated_at": time.time()}).encode()
    # kv.put has no TTL argument (nor headers): the entry is written as a message on its key.
    ttl = max(1.0, ttl_s or ENTRY_TTL_S) if await entry_ttl_supported(js, topo) else None
    await put_entry(js, topo.workers_bucket, worker_id, payload, JSON.headers(), msg_ttl=ttl)


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
    the engines' versions), in key order; an entry that expires or is deleted between listing
    and reading is skipped.

    Not ``kv.keys()``: its watcher (nats-py 2.x) says "no more keys" when the consumer's info
    reports nothing pending while its subscription has counted no delivery yet, which on a
    loaded machine happens while the entries are still on their way, and the bucket reads
    empty. Here the stream's info lists the subjects that hold a message (``subjects_filter``),
    and each subject's last message is asked for by name: nothing depends on timing.
    """
    stream = f"KV_{bucket}"
    try:
        info = await js.stream_info(stream, subjects_filter=f"$KV.{bucket}.>")
    except nats.js.errors.NotFoundError as exc:  # what js.key_value(bucket) raised before
        raise nats.js.errors.BucketNotFoundError from exc
    subjects = sorted(info.state.subjects or {})
    messages = await asyncio.gather(*(_last_message(js, stream, s) for s in subjects))
    return [json.loads(msg.data) for msg in messages if msg is not None and msg.data]


async def _last_message(js: JetStreamContext, stream: str, subject: str) -> RawStreamMsg | None:
    """The subject's last message, or None when it is gone or is a removal (a delete or purge
    marker, or a 2.11+ server's expiry marker)."""
    try:
        msg = await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return None
    headers = msg.headers or {}
    if headers.get(KV_OP) in (KV_DEL, KV_PURGE) or KV_MARKER_REASON in headers:
        return None
    return msg


async def live_workers(js: JetStreamContext, topo: Topology) -> list[dict[str, Any]]:
    workers = await json_entries(js, topo.workers_bucket)
    return sorted(workers, key=lambda w: w.get("worker_id", ""))
