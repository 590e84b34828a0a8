"""The chaos scenarios, each a coroutine that runs one batch under one kind of fault and
returns its ``Row``. The tests (``tests/chaos/test_*.py``) run them small; ``bench/chaos.py``
runs them long and prints the table. Each takes the broker it runs on (started by the caller:
a conftest fixture, or the bench) and a directory for logs.

Shared settings: the agents' consumer has ``ack_wait`` 3 s (the least the worker accepts), so a
job held by a killed process comes back within seconds; the LLM fleet is the fake SGLang
server of the tests, in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from chaoslib import AGENT, ChaosRun, ConsumerPool, Row
from fake_sglang import FakeSGLang

from broker import Limits, NatsServer, NatsSettings, Topology, provision
from broker.registry import live_workers

ACK_WAIT_S = 3.0
LIMITS = Limits(ack_wait_s=ACK_WAIT_S, attempts=3)
CONSUMER_FLAGS = ("--ack-wait", str(ACK_WAIT_S), "--retry-delay", "0.1", "--drain-grace", "10")


@contextlib.asynccontextmanager
async def session(url: str, limits: Limits = LIMITS) -> AsyncIterator:
    """A connection with the streams and the counted agent's consumer provisioned."""
    nc = await NatsSettings(url=url).connect(name="chaos-harness")
    try:
        js = nc.jetstream()
        await provision(js, Topology(), limits, agents=(AGENT,))
        yield js
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def fake_fleet() -> AsyncIterator[FakeSGLang]:
    fake = FakeSGLang(output_ids=[49], text="1")
    fake.requests = _Tally()  # counts only: a long run would keep every request body
    await fake.start()
    try:
        yield fake
    finally:
        await fake.close()


class _Tally(list):
    def append(self, item) -> None:
        self.n = getattr(self, "n", 0) + 1

    def __len__(self) -> int:
        return getattr(self, "n", 0)


async def until(predicate, timeout_s: float, what: str) -> None:
    """Poll an async predicate (process and server state have no event to await)."""
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout_s}s")
        await asyncio.sleep(0.1)


async def registered(js, pool: ConsumerPool, timeout_s: float = 60.0) -> None:
    """Until every running consumer of the pool is in the workers registry (it registers once
    it is bound and pulling)."""

    async def check() -> bool:
        ids = {w.get("worker_id", "") for w in await live_workers(js, Topology())}
        return set(pool.worker_ids.values()) <= ids

    await until(check, timeout_s, "consumers registered")


def chunks(n: int, parts: int) -> list[range]:
    step = -(-n // parts)
    return [range(i, min(n, i + step)) for i in range(0, n, step)]


async def consumer_kill_storm(
    server: NatsServer,
    workdir: Path,
    *,
    jobs: int = 1500,
    consumers: int = 3,
    kills: int = 4,
    every_s: float = 2.5,
    sleep_s: float = 0.3,
    concurrency: int = 16,
    command: str = "",
) -> Row:
    """Three consumer processes; every ``every_s`` one of them (in turn) is SIGKILLed and
    started again at once. The jobs are published in ``kills + 1`` chunks, one before each
    kill, so every kill lands on a busy pool."""
    async with session(server.url) as js, fake_fleet() as fake:
        run = ChaosRun(js, workdir)
        pool = ConsumerPool(
            run,
            server.url,
            [fake.url],
            extra=("--concurrency", str(concurrency), *CONSUMER_FLAGS),
        )
        try:
            for slot in range(consumers):
                pool.start(slot)
            await registered(js, pool)
            parts = chunks(jobs, kills + 1)
            for i in range(kills):
                await run.publish(parts[i], sleep_s=sleep_s)
                await asyncio.sleep(every_s)  # the storm's rhythm is the point
                slot = i % consumers
                pid = pool.children[slot].proc.pid
                with run.fault(f"SIGKILL consumer {slot}", pids=[pid]):
                    pool.kill(slot)
                pool.restart(slot)
            for part in parts[kills:]:
                await run.publish(part, sleep_s=sleep_s)
            await run.wait_settled(120 + jobs / 20)
            await registered(js, pool)  # a consumer stopped while it starts dies of SIGTERM
        finally:
            codes = pool.stop()
        assert all(code == 0 for code in codes), codes  # the survivors drained cleanly
        return await run.tally(
            f"consumer kill storm: {consumers} consumers, {kills} SIGKILLs every {every_s:g} s",
            command=command,
        )
