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
import dataclasses
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

from chaoslib import AGENT, ChaosRun, ConsumerPool, Row
from fake_sglang import FakeSGLang
from nats.js.api import DiscardPolicy

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


async def _two_consumers_batch(
    server: NatsServer,
    workdir: Path,
    *,
    jobs: int,
    sleep_s: float,
    concurrency: int,
    fault,
    scenario: str,
    command: str,
) -> Row:
    """Two consumer processes work a batch; ``fault(run, publish_rest)`` is injected once a
    quarter of the first half is stored and publishes the second half while it lasts."""
    async with session(server.url) as js, fake_fleet() as fake:
        run = ChaosRun(js, workdir)
        pool = ConsumerPool(
            run,
            server.url,
            [fake.url],
            extra=("--concurrency", str(concurrency), *CONSUMER_FLAGS),
        )
        first, second = chunks(jobs, 2)
        try:
            for slot in range(2):
                pool.start(slot)
            await registered(js, pool)
            await run.publish(first, sleep_s=sleep_s)

            async def some_stored() -> bool:
                info = await js.stream_info(run.topo.trajectories_stream)
                return info.state.messages >= len(first) // 4

            await until(some_stored, 60, "a quarter of the first half stored")

            async def publish_rest() -> None:
                await run.publish(second, sleep_s=sleep_s)

            await fault(run, publish_rest)
            await run.wait_settled(120 + jobs / 20)
            await registered(js, pool)
        finally:
            codes = pool.stop()
        assert all(code == 0 for code in codes), codes  # drained cleanly after the fault
        return await run.tally(scenario, command=command)


async def broker_restart(
    server: NatsServer,
    workdir: Path,
    *,
    jobs: int = 600,
    down_s: float = 2.0,
    sleep_s: float = 0.2,
    concurrency: int = 16,
    command: str = "",
) -> Row:
    """A single-node broker with a file store, SIGKILLed mid-batch and started again on the
    same port and store ``down_s`` later; the second half of the batch is published while it
    is down (the producer waits and retries)."""

    async def crash(run: ChaosRun, publish_rest) -> None:
        with run.fault("broker SIGKILL, restart"):
            server.kill()
            publishing = asyncio.create_task(publish_rest())
            await asyncio.sleep(down_s)  # the outage's length is the point
            await asyncio.to_thread(server.start)
        await asyncio.wait_for(publishing, 120)

    return await _two_consumers_batch(
        server,
        workdir,
        jobs=jobs,
        sleep_s=sleep_s,
        concurrency=concurrency,
        fault=crash,
        scenario=f"broker SIGKILL mid-batch, restarted after {down_s:g} s (single node, file store)",
        command=command,
    )


async def broker_pause(
    server: NatsServer,
    workdir: Path,
    *,
    jobs: int = 600,
    pause_s: float = 2.5 * ACK_WAIT_S,
    sleep_s: float = 0.2,
    concurrency: int = 16,
    command: str = "",
) -> Row:
    """The broker SIGSTOPped for longer than the ack wait (no heartbeat reaches it, so every
    job in flight is due for redelivery when it wakes), then SIGCONTinued."""

    async def pause(run: ChaosRun, publish_rest) -> None:
        assert server.pid is not None
        with run.fault(f"broker SIGSTOP for {pause_s:g} s"):
            os.kill(server.pid, signal.SIGSTOP)
            try:
                publishing = asyncio.create_task(publish_rest())
                await asyncio.sleep(pause_s)  # the pause's length is the point
            finally:
                os.kill(server.pid, signal.SIGCONT)
        await asyncio.wait_for(publishing, 120)

    return await _two_consumers_batch(
        server,
        workdir,
        jobs=jobs,
        sleep_s=sleep_s,
        concurrency=concurrency,
        fault=pause,
        scenario=f"broker SIGSTOP {pause_s:g} s (ack wait {ACK_WAIT_S:g} s), then SIGCONT",
        command=command,
    )


async def slow_rollouts(
    server: NatsServer,
    workdir: Path,
    *,
    jobs: int = 32,
    sleep_s: float = 2.5 * ACK_WAIT_S,
    command: str = "",
) -> Row:
    """One consumer whose every rollout outlives the ack wait (the agent holds each job for
    ``sleep_s``): heartbeats keep the jobs, so none is delivered twice."""
    async with session(server.url) as js, fake_fleet() as fake:
        run = ChaosRun(js, workdir)
        pool = ConsumerPool(
            run, server.url, [fake.url], extra=("--concurrency", str(jobs), *CONSUMER_FLAGS)
        )
        try:
            pool.start(0)
            await registered(js, pool)
            await run.publish(range(jobs), sleep_s=sleep_s)
            await run.wait_settled(120 + sleep_s * 2)
            info = await js.consumer_info(run.topo.tasks_stream, run.topo.rollout_consumer(AGENT))
        finally:
            codes = pool.stop()
        assert codes == [0], codes
        assert info.num_redelivered == 0 and info.delivered.consumer_seq == jobs, info
        return await run.tally(
            f"slow rollouts: {sleep_s:g} s each, ack wait {ACK_WAIT_S:g} s (heartbeats)",
            command=command,
        )


async def store_full(
    server: NatsServer,
    workdir: Path,
    *,
    jobs: int = 300,
    room: int = 60,
    full_s: float = 2 * ACK_WAIT_S,
    concurrency: int = 16,
    command: str = "",
) -> Row:
    """The store fills up: TRAJECTORIES and TASKS get byte limits that refuse new messages
    (discard new, as a full disk refuses writes) with room for ``room`` more of each. The
    producer must wait, the consumers must hold their finished jobs (heartbeated, not
    redelivered, not dead-lettered) for ``full_s`` past the moment the store is full; then the
    operator raises the limits and everything lands."""
    async with session(server.url) as js, fake_fleet() as fake:
        topo = Topology()
        run = ChaosRun(js, workdir)
        pool = ConsumerPool(
            run, server.url, [fake.url], extra=("--concurrency", str(concurrency), *CONSUMER_FLAGS)
        )
        try:
            pool.start(0)
            await registered(js, pool)
            warmup = 20  # jobs stored with no limit, to learn a trajectory's and a job's size
            await run.publish(range(warmup))
            await run.wait_settled(60)
            trajectories = await js.stream_info(topo.trajectories_stream)
            per_trajectory = trajectories.state.bytes / trajectories.state.messages
            with run.fault("store full (byte limits, discard new)"):
                original = {}
                for stream, size in (
                    (topo.trajectories_stream, per_trajectory),
                    (topo.tasks_stream, per_trajectory / 2),
                ):
                    info = await js.stream_info(stream)
                    original[stream] = info.config
                    config = dataclasses.replace(
                        info.config,
                        max_bytes=int(info.state.bytes + room * size),
                        discard=DiscardPolicy.NEW,
                    )
                    await js.update_stream(config)
                publishing = asyncio.create_task(run.publish(range(warmup, jobs)))

                async def full() -> bool:
                    info = await js.stream_info(topo.trajectories_stream)
                    consumer = await js.consumer_info(topo.tasks_stream, topo.rollout_consumer(AGENT))
                    return (
                        info.state.bytes + per_trajectory > info.config.max_bytes
                        and consumer.num_ack_pending > 0
                    )

                await until(full, 60, "the trajectories stream full with jobs held")
                await asyncio.sleep(full_s)  # held past the ack wait: the length is the point
                assert not publishing.done()  # the producer is waiting for room
                for config in original.values():
                    await js.update_stream(config)
            await asyncio.wait_for(publishing, 120)
            await run.wait_settled(120)
            info = await js.consumer_info(topo.tasks_stream, topo.rollout_consumer(AGENT))
        finally:
            codes = pool.stop()
        assert codes == [0], codes
        assert info.num_redelivered == 0, info
        return await run.tally(
            f"store full: byte limits refuse writes for {full_s:g} s (ack wait {ACK_WAIT_S:g} s)",
            command=command,
        )
