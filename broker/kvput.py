"""put_entry: a KV entry written with headers, its ``Content-Type`` among them.

nats-py's ``KeyValue.put`` sends no headers, and an entry is only a message on its key's
subject (``$KV.<bucket>.<key>``), so the entry is published there directly, with the same
result: the bucket's stream stores it as the key's latest value.
"""

from __future__ import annotations

from collections.abc import Mapping

from nats.js import JetStreamContext


def kv_subject(bucket: str, key: str) -> str:
    return f"$KV.{bucket}.{key}"


async def put_entry(
    js: JetStreamContext,
    bucket: str,
    key: str,
    value: bytes,
    headers: Mapping[str, str],
    *,
    msg_ttl: float | None = None,
) -> int:
    """Write ``key`` = ``value`` with ``headers`` (``msg_ttl``: the entry's own TTL, nats-server
    2.11+); returns the entry's revision. A missing bucket raises nats-py's
    ``NoStreamResponseError``."""
    ack = await js.publish(kv_subject(bucket, key), value, headers=dict(headers), msg_ttl=msg_ttl)
    return ack.seq
