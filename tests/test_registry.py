"""The KV registry reader (broker.registry.json_entries): every live entry, whatever the load.

nats-py's ``kv.keys()`` could end its listing before the entries arrived on a loaded machine
(its watcher trusts an empty consumer info over messages still on their way), and a registry
of two workers read empty. The reader now asks the stream for each subject's last message.
"""

from __future__ import annotations

import asyncio
import json
import time

import nats.js.errors
import pytest

from agentarium.broker import provision
from agentarium.broker.registry import json_entries, live_workers, publish_worker

N = 150


async def _spin(stop: asyncio.Event) -> None:
    """Keep the event loop busy: 2 ms of CPU between yields."""
    while not stop.is_set():
        started = time.perf_counter()
        while time.perf_counter() - started < 0.002:
            pass
        await asyncio.sleep(0)


async def test_every_entry_is_read_while_the_loop_is_loaded(js, topology):
    await provision(js, topology)
    kv = await js.key_value(topology.workers_bucket)
    await asyncio.gather(
        *(kv.put(f"w{i:03d}", json.dumps({"worker_id": f"w{i:03d}"}).encode()) for i in range(N))
    )
    await kv.delete("w007")  # a delete marker is the key's last message: not an entry
    await kv.purge("w008")
    await kv.put("w009", b"")  # an empty value is no entry either
    expected = [f"w{i:03d}" for i in range(N) if i not in (7, 8, 9)]

    stop = asyncio.Event()
    spinners = [asyncio.create_task(_spin(stop)) for _ in range(8)]
    try:
        reads = await asyncio.gather(*(json_entries(js, topology.workers_bucket) for _ in range(5)))
    finally:
        stop.set()
        await asyncio.gather(*spinners)
    for entries in reads:
        assert [e["worker_id"] for e in entries] == expected  # all of them, in key order


async def test_a_registry_of_two_workers_reads_two(js, topology):
    await provision(js, topology)
    for worker_id in ("w2", "w1"):
        await publish_worker(js, topology, worker_id, {"agent": "toy"})
    assert [w["worker_id"] for w in await live_workers(js, topology)] == ["w1", "w2"]


async def test_an_empty_registry_reads_empty_and_a_missing_bucket_says_so(js, topology):
    await provision(js, topology)
    assert await live_workers(js, topology) == []
    with pytest.raises(nats.js.errors.BucketNotFoundError):
        await json_entries(js, "no-such-bucket")
