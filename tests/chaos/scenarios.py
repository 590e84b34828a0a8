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
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

from chaos_agents import HOLD_ENV
from chaoslib import AGENT, ChaosRun, ConsumerPool, Row, patiently, read_executions, until
from fake_sglang import FakeSGLang
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy

from agentarium.broker import Limits, NatsServer, NatsSettings, Topology, provision
from agentarium.broker.registry import live_workers
from agentarium.broker.version import DISCARD_NEW_BYTES_SINCE, format_version, js_server_version

ACK_WAIT_S = 3.0
LIMITS = Limits(ack_wait_s=ACK_WAIT_S, attempts=3)
CONSUMER_FLAGS = ("--ack-wait", str(ACK_WAIT_S), "--retry-delay", "0.1", "--drain-grace", "10")


@contextlib.asynccontextmanager
async def session(url: str, limits: Limits = LIMITS) -> AsyncIterator:
    """A connection with the streams and the counted agent's consumer provisioned."""
    nc = await NatsSettings(url=url).connect(name="chaos-harness")
    try:
        js = nc.jetstream()
        # a cluster that just elected its meta leader may time out the first requests
        await patiently(lambda: provision(js, Topology(), limits, agents=(AGENT,)))
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


@contextlib.asynccontextmanager
async def consumers_on(
    url: str, workdir: Path, concurrency: int, *, limits: Limits = LIMITS
) -> AsyncIterator[tuple[JetStreamContext, ChaosRun, ConsumerPool]]:
    """A session on the broker, the fake LLM fleet, the run, and its pool of consumers (none
    started yet) with ``--concurrency`` and the shared ``CONSUMER_FLAGS``."""
    async with session(url, limits) as js, fake_fleet() as fake:
        run = ChaosRun(js, workdir)
        extra = ("--concurrency", str(concurrency), *CONSUMER_FLAGS)
        yield js, run, ConsumerPool(run, url, [fake.url], extra=extra)


class _Tally(list):
    def append(self, item) -> None:
        self.n = getattr(self, "n", 0) + 1

    def __len__(self) -> int:
        return getattr(self, "n", 0)


async def registered(js, pool: ConsumerPool, timeout_s: float = 60.0) -> None:
    """Until every running consumer of the pool is in the workers registry (it registers once
    it is bound and pulling)."""

    async def check() -> bool:
        ids = {w.get("worker_id", "") for w in await live_workers(js, Topology())}
        return set(pool.worker_ids.values()) <= ids

    await until(check, timeout_s, "consumers registered")


async def stored_count(js) -> int:
    return (await js.stream_info(Topology().trajectories_stream)).state.messages


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
    """Three consumer processes; one of them (in turn) is SIGKILLed and started again at once,
    ``every_s`` after the last kill or sooner: the jobs are published in ``kills + 1`` chunks,
    one before each kill, and a kill comes once half its chunk is stored if that is sooner,
    so that every kill lands on a busy pool, on a fast machine too."""
    async with consumers_on(server.url, workdir, concurrency) as (js, run, pool):
        try:
            for slot in range(consumers):
                pool.start(slot)
            await registered(js, pool)
            parts = chunks(jobs, kills + 1)
            for i in range(kills):
                stored0 = await stored_count(js)
                await run.publish(parts[i], sleep_s=sleep_s)

                async def half_done(chunk: range = parts[i], before: int = stored0) -> bool:
                    return await stored_count(js) - before >= len(chunk) // 2

                with contextlib.suppress(TimeoutError):  # the storm's rhythm is the point
                    await until(half_done, every_s, "half the chunk stored")
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
            codes = await pool.stop()
        assert all(code == 0 for code in codes), codes  # the survivors drained cleanly
        return await run.tally(
            f"consumer kill storm: {consumers} consumers, {kills} SIGKILLs, one every "
            f"{every_s:g} s or sooner",
            command=command,
        )


async def _two_consumers_batch(
    server: NatsServer,
    workdir: Path,
    *,
    fault,
    scenario: str,
    jobs: int = 600,
    sleep_s: float = 0.2,
    concurrency: int = 16,
    command: str = "",
) -> Row:
    """Two consumer processes work a batch; ``fault(run, publish_rest)`` is injected once a
    quarter of the first half is stored and publishes the second half while it lasts. The
    broker scenarios pass their keywords on (``batch``) to the batch's size and pace here."""
    async with consumers_on(server.url, workdir, concurrency) as (js, run, pool):
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
            codes = await pool.stop()
        assert all(code == 0 for code in codes), codes  # drained cleanly after the fault
        return await run.tally(scenario, command=command)


async def broker_restart(
    server: NatsServer, workdir: Path, *, down_s: float = 2.0, **batch: Any
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

    scenario = f"broker SIGKILL mid-batch, restarted after {down_s:g} s (single node, file store)"
    return await _two_consumers_batch(server, workdir, fault=crash, scenario=scenario, **batch)


async def broker_pause(
    server: NatsServer, workdir: Path, *, pause_s: float = 2.5 * ACK_WAIT_S, **batch: Any
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

    scenario = f"broker SIGSTOP {pause_s:g} s (ack wait {ACK_WAIT_S:g} s), then SIGCONT"
    return await _two_consumers_batch(server, workdir, fault=pause, scenario=scenario, **batch)


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
    async with consumers_on(server.url, workdir, jobs) as (js, run, pool):
        try:
            pool.start(0)
            await registered(js, pool)
            await run.publish(range(jobs), sleep_s=sleep_s)
            await run.wait_settled(120 + sleep_s * 2)
            info = await js.consumer_info(run.topo.tasks_stream, run.topo.rollout_consumer(AGENT))
        finally:
            codes = await pool.stop()
        assert codes == [0], codes
        assert info.num_redelivered == 0 and info.delivered.consumer_seq == jobs, info
        return await run.tally(
            f"slow rollouts: {sleep_s:g} s each, ack wait {ACK_WAIT_S:g} s (heartbeats)",
            command=command,
        )


async def scale_down(
    server: NatsServer,
    workdir: Path,
    *,
    short: int = 4,
    long: int = 4,
    short_s: float = 1.0,
    long_s: float = 6.0,
    drains: int = 4,
    grace_s: float = 3.0,
    command: str = "",
) -> Row:
    """KEDA scaling the fleet down, over and over, while it holds long rollouts: each consumer
    in turn takes the long jobs and gets SIGTERM mid-rollout (``--drain-grace grace_s``). The
    first also holds short jobs, which finish within the grace; the long ones are requeued
    each time, and a last consumer, left alone, runs them to the end. The agent's consumer
    allows 4 deliveries (3 attempts, no lost delivery), fewer than a long job's ``drains`` + 1
    runs: a release that spent a delivery (a nak) would dead-letter them as max_deliveries."""
    limits = Limits(ack_wait_s=ACK_WAIT_S, attempts=3, lost_deliveries=0)
    flags = (
        "--ack-wait",
        str(ACK_WAIT_S),
        "--retry-delay",
        "0.1",
        "--drain-grace",
        f"{grace_s:g}",
        "--concurrency",
        str(short + long),
    )
    short_keys, long_keys = range(short), range(short, short + long)
    async with session(server.url, limits) as js, fake_fleet() as fake:
        run = ChaosRun(js, workdir)
        durable = run.topo.rollout_consumer(AGENT)
        pool = ConsumerPool(run, server.url, [fake.url], extra=flags)

        async def running(keys: range, pid: int) -> bool:
            ran = {e.key for e in read_executions(run.exec_log) if e.pid == pid}
            return set(keys) <= ran

        drained_s: list[float] = []
        try:
            for drain in range(drains):
                pid = (pool.restart(0) if drain else pool.start(0)).proc.pid
                await registered(js, pool)
                if drain == 0:
                    await run.publish(short_keys, sleep_s=short_s)
                    await run.publish(long_keys, sleep_s=long_s)
                keys = range(short + long) if drain == 0 else long_keys
                await until(lambda k=keys, p=pid: running(k, p), 60, "the batch running")
                with run.fault(f"SIGTERM (scale-down) #{drain + 1}", pids=[pid]):
                    began = time.monotonic()
                    code = await pool.terminate(0)
                    drained_s.append(time.monotonic() - began)
                assert code == 0, f"drain {drain + 1} exited {code}"
            pool.restart(0)  # the consumer that stays
            await run.wait_settled(long_s + 60)
            info = await js.consumer_info(run.topo.tasks_stream, durable)
            attempts = await js.key_value(run.topo.attempts_bucket)
            failures = (await attempts.status()).values
        finally:
            codes = await pool.stop()
        assert codes == [0], codes
        assert info.config.max_deliver == 4, info.config
        # releases are fresh messages: no delivery was a redelivery, and no run was a failure
        assert info.num_redelivered == 0, info
        assert info.delivered.consumer_seq == short + long * (drains + 1), info
        assert failures == 0, f"{failures} failed runs counted"
        grace_limit = grace_s + 5.0 + 3.0  # the grace, the requeue's bound, process exit
        assert max(drained_s) <= grace_limit, drained_s
        return await run.tally(
            f"{drains} scale-downs (SIGTERM, --drain-grace {grace_s:g} s) of consumers holding "
            f"{long} rollouts of {long_s:g} s, on a consumer allowing 4 deliveries; {short} "
            f"rollouts of {short_s:g} s finish within the grace (drains took "
            f"{min(drained_s):.1f}-{max(drained_s):.1f} s)",
            command=command,
        )


async def crash_recovery(
    server: NatsServer,
    workdir: Path,
    *,
    held: int = 100,
    slow: int = 8,
    rollout_s: float = 180.0,
    command: str = "",
) -> Row:
    """The default ``ack_wait`` (10 s) against both of its jobs at once: a consumer SIGKILLed
    with ``held`` jobs in flight has them run elsewhere within seconds, while a live consumer's
    ``slow`` rollouts of ``rollout_s`` each, running all along, are never redelivered.

    Three processes on one agent, started in turn so that each takes exactly its share: the
    slow consumer (``--concurrency slow``) takes the slow jobs; the doomed one
    (``--concurrency held``, holding every job until it dies) takes the held jobs; the rescuer
    starts once every job is taken, so it has nothing to pull until the kill. Every process
    runs with the consumer's defaults (no ``--ack-wait``), on an agent consumer provisioned
    with the broker's defaults."""
    limits = Limits()
    flags = ("--retry-delay", "0.1", "--drain-grace", "10")
    async with session(server.url, limits) as js, fake_fleet() as fake:
        run = ChaosRun(js, workdir)
        durable = run.topo.rollout_consumer(AGENT)
        ack_wait = (await js.consumer_info(run.topo.tasks_stream, durable)).config.ack_wait
        assert ack_wait == limits.ack_wait_s, ack_wait  # the defaults are what is measured

        pool = ConsumerPool(run, server.url, [fake.url], extra=flags)
        slow_keys, held_keys = range(slow), range(slow, slow + held)

        def concurrency(n: int) -> tuple[str, ...]:
            return ("--concurrency", str(n))

        async def running(keys: range, pid: int) -> bool:
            ran = {e.key for e in read_executions(run.exec_log) if e.pid == pid}
            return set(keys) <= ran

        try:
            survivor = pool.start(0, concurrency(slow)).proc.pid
            await registered(js, pool)
            await run.publish(slow_keys, sleep_s=rollout_s)
            await until(lambda: running(slow_keys, survivor), 60, "the slow rollouts started")
            doomed = pool.start(1, concurrency(held), **{HOLD_ENV: "3600"}).proc.pid
            await registered(js, pool)
            await run.publish(held_keys)
            await until(lambda: running(held_keys, doomed), 60, "the held jobs started")
            pool.start(2, concurrency(held))  # the rescuer: every job is taken, it waits
            await registered(js, pool)
            with run.fault(f"SIGKILL the consumer holding {held} jobs", pids=[doomed]):
                pool.kill(1)
            await run.wait_settled(rollout_s + 120)
            info = await js.consumer_info(run.topo.tasks_stream, durable)
        finally:
            codes = await pool.stop()
        assert codes[0] == codes[2] == 0, codes  # the survivors drained cleanly
        executions = read_executions(run.exec_log)
        # every job delivered once, the killed consumer's once more: nothing else redelivered
        runs = Counter(e.key for e in executions)
        again = {k: [(e.pid, round(e.at - run.started, 1)) for e in executions if e.key == k]
                 for k, n in runs.items() if n != (2 if k in held_keys else 1)}  # fmt: skip
        assert info.delivered.consumer_seq == slow + 2 * held, (
            f"{info.delivered.consumer_seq} deliveries, not {slow + 2 * held}; jobs run other "
            f"than expected (pid, s after start): {again}; pids: survivor {survivor}, doomed "
            f"{doomed}, rescuer {pool.children[2].proc.pid}; killed at "
            f"{run.faults[0].start - run.started:.1f} s"
        )
        back = min(e.at for e in executions if e.key in held_keys and e.pid != doomed)
        kill = run.faults[0].start
        return await run.tally(
            f"consumer SIGKILLed holding {held} jobs, default ack wait {ack_wait:g} s (first job "
            f"back {back - kill:.1f} s after the kill), beside {slow} live {rollout_s:g} s "
            "rollouts (delivered once each)",
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
    """The store fills up: TRAJECTORIES and TASKS get limits that refuse new messages
    (discard new, as a full disk refuses writes) with room for ``room`` more of each: byte
    limits on nats-server 2.10.5+, message limits before it (whose byte limits delete the
    oldest messages instead of refusing: broker/version.py). The producer must wait, the
    consumers must hold their finished jobs (heartbeated, not redelivered, not dead-lettered)
    for ``full_s`` past the moment the store is full; then the operator raises the limits and
    everything lands."""
    async with consumers_on(server.url, workdir, concurrency) as (js, run, pool):
        topo = Topology()
        try:
            pool.start(0)
            await registered(js, pool)
            warmup = 20  # jobs stored with no limit, to learn a trajectory's and a job's size
            await run.publish(range(warmup))
            await run.wait_settled(60)
            trajectories = await js.stream_info(topo.trajectories_stream)
            per_trajectory = trajectories.state.bytes / trajectories.state.messages
            version = js_server_version(js)
            by_bytes = version >= DISCARD_NEW_BYTES_SINCE
            kind = "byte" if by_bytes else "message"
            with run.fault(f"store full ({kind} limits, discard new)"):
                original = {}
                for stream, size in (
                    (topo.trajectories_stream, per_trajectory),
                    (topo.tasks_stream, per_trajectory / 2),
                ):
                    info = await js.stream_info(stream)
                    original[stream] = info.config
                    limit = (
                        {"max_bytes": int(info.state.bytes + room * size)}
                        if by_bytes
                        else {"max_msgs": info.state.messages + room}
                    )
                    config = dataclasses.replace(info.config, discard=DiscardPolicy.NEW, **limit)
                    await js.update_stream(config)
                publishing = asyncio.create_task(run.publish(range(warmup, jobs)))

                async def full() -> bool:
                    info = await js.stream_info(topo.trajectories_stream)
                    consumer = await js.consumer_info(
                        topo.tasks_stream, topo.rollout_consumer(AGENT)
                    )
                    full = (
                        info.state.bytes + per_trajectory > info.config.max_bytes
                        if by_bytes
                        else info.state.messages >= info.config.max_msgs
                    )
                    return full and consumer.num_ack_pending > 0

                await until(full, 60, "the trajectories stream full with jobs held")
                await asyncio.sleep(full_s)  # held past the ack wait: the length is the point
                assert not publishing.done()  # the producer is waiting for room
                for config in original.values():
                    await js.update_stream(config)
            await asyncio.wait_for(publishing, 120)
            await run.wait_settled(120)
            info = await js.consumer_info(topo.tasks_stream, topo.rollout_consumer(AGENT))
        finally:
            codes = await pool.stop()
        assert codes == [0], codes
        assert info.num_redelivered == 0, info
        return await run.tally(
            f"store full: {kind} limits refuse writes for {full_s:g} s (ack wait {ACK_WAIT_S:g} s, "
            f"nats-server {format_version(version)})",
            command=command,
        )


async def fleet_down(
    server: NatsServer,
    workdir: Path,
    *,
    jobs: int = 400,
    outage_s: float = 5.0,
    hang: bool = False,
    probe_s: float = 5.0,
    sleep_s: float = 0.2,
    concurrency: int = 16,
    command: str = "",
) -> Row:
    """The whole LLM fleet (one server) goes away mid-batch for ``outage_s``: closed
    (connections refused), or with ``hang`` accepting requests and never answering. Two
    consumer processes must hold their rollouts and take nothing new until it answers again
    (``--fleet-probe-interval``/``--fleet-probe-timeout`` ``probe_s``): no error, no dead
    letter, no attempt spent."""
    async with session(server.url) as js, fake_fleet() as fake:
        run = ChaosRun(js, workdir)
        flags = ("--fleet-probe-interval", str(probe_s), "--fleet-probe-timeout", str(probe_s))
        pool = ConsumerPool(
            run,
            server.url,
            [fake.url],
            extra=("--concurrency", str(concurrency), *CONSUMER_FLAGS, *flags),
        )
        try:
            for slot in range(2):
                pool.start(slot)
            await registered(js, pool)
            await run.publish(range(jobs), sleep_s=sleep_s)

            async def some_stored() -> bool:
                info = await js.stream_info(run.topo.trajectories_stream)
                return info.state.messages >= jobs // 4

            await until(some_stored, 60, "a quarter of the batch stored")
            how = "hung (accepts, never answers)" if hang else "closed (connections refused)"
            with run.fault(f"LLM fleet {how} for {outage_s:g} s"):
                if hang:
                    fake.hang()
                else:
                    await fake.stop()
                await asyncio.sleep(outage_s)  # the outage's length is the point
                if hang:
                    fake.unhang()
                else:
                    await fake.start()
            await run.wait_settled(120 + jobs / 20)
            info = await js.consumer_info(run.topo.tasks_stream, run.topo.rollout_consumer(AGENT))
        finally:
            codes = await pool.stop()
        assert all(code == 0 for code in codes), codes
        assert info.num_redelivered == 0, info  # held rollouts kept their delivery
        return await run.tally(
            f"LLM fleet {'hung' if hang else 'down'} {outage_s:g} s mid-batch "
            f"(probe every {probe_s:g} s)",
            command=command,
        )


TRAIN_RUN, TRAIN_AGENT = "chaos-train", "toy"


async def trainer_kill_storm(
    server: NatsServer,
    workdir: Path,
    *,
    groups: int = 16,
    kills: int = 2,
    groups_per_step: int = 2,
    checkpoint_every: int = 2,
    command: str = "",
) -> Row:
    """The trainer SIGKILLed ``kills`` times over one run and resumed (``--resume``) at once
    each time; kills alternate between right after a checkpoint and one step past it (that
    step is computed again). Trajectories are published in stages, one per kill, so each kill
    lands where it is aimed: on a trainer waiting for more. What was trained is read back from
    the checkpoints' job id lists: every trajectory exactly once.

    The row's columns read for training: jobs are trajectories, stored those trained, lost
    those never trained, duplicates those trained twice; "run more than once" counts training
    steps computed again (each kill may cost the steps done since its last checkpoint)."""
    from trainlib import TrainerChild, one_call_group, publish

    from agentarium.trainer.checkpoint import Checkpoints

    steps = groups // groups_per_step
    run_agent = {"run": TRAIN_RUN, "agent": TRAIN_AGENT}
    flags = (
        "--groups-per-step",
        str(groups_per_step),
        "--checkpoint-every",
        str(checkpoint_every),
        "--max-steps",
        str(steps),
    )
    items = [
        t
        for g in range(groups)
        for t in one_call_group(
            g,
            run=TRAIN_RUN,
            agent=TRAIN_AGENT,
            job_id=lambda g, i: f"job-{g}-{i}",
            group_id=f"group-{g}",
            reward=lambda g, i: float(i == g % 4),
        )
    ]
    per_step = groups_per_step * 4
    async with session(server.url) as js:
        topo = Topology()
        trainers = [await TrainerChild.start(server.url, workdir, *flags, **run_agent)]
        stages = []  # per kill: (the checkpoint it follows, the step it waits for)
        for k in range(kills):
            checkpoint = (k + 1) * steps // (kills + 1)
            checkpoint -= checkpoint % checkpoint_every
            stages.append((checkpoint, checkpoint + k % 2))  # odd kills: one step past it
        ends = [stop_at * per_step for _, stop_at in stages] + [len(items)]
        await publish(js, topo, items[: ends[0]])
        costs: list[int] = []  # per kill: steps done since the last checkpoint
        recoveries: list[float] = []
        try:
            for k, (checkpoint, stop_at) in enumerate(stages):
                trainer = trainers[-1]
                await trainer.wait_for("step done", step=stop_at)
                await trainer.wait_for("checkpoint saved", step=checkpoint)
                await trainer.kill()
                killed_at = time.time()
                last = max(trainer.checkpointed(), trainer.resumed_step())
                costs.append(max(trainer.steps_done(), default=0) - last)
                resumed = await TrainerChild.start(
                    server.url, workdir, *flags, "--resume", **run_agent
                )
                trainers.append(resumed)
                await publish(js, topo, items[ends[k] : ends[k + 1]])
                first = await resumed.wait_for("step done")
                recoveries.append(first["_at"] - killed_at)
            assert await trainers[-1].exit_code() == 0, trainers[-1].events[-5:]
        finally:
            for trainer in trainers:
                if trainer.proc.returncode is None:
                    trainer.proc.kill()
                    await trainer.proc.wait()

    history = Checkpoints(workdir / "ckpt").history()
    trained = Counter(j for h in history for j in h["trained_job_ids"])
    ok = {t.job_id for t in items}
    computed = Counter(s for t in trainers for s in t.steps_done())
    assert set(computed) == set(range(1, steps + 1)), computed
    return Row(
        scenario=f"trainer SIGKILL storm: {kills} kills over {steps} steps, checkpoint every "
        f"{checkpoint_every} (redone: training steps)",
        jobs=len(items),
        stored=len(trained.keys() & ok),
        lost=len(ok - trained.keys()),
        duplicates=sum(n - 1 for n in trained.values()),
        rerun=sum(1 for n in computed.values() if n > 1),
        extra_runs=sum(n - 1 for n in computed.values()),
        in_flight=sum(costs),
        dead=0,
        errors=0,
        recovery_s=max(recoveries, default=0.0),
        stall_s=max(recoveries, default=0.0),  # nothing trains from the kill to that step
        faults=kills,
        command=command,
    )


CLUSTER_FAULTS = ("leader kill", "follower kill", "partition")


async def cluster_faults(
    workdir: Path,
    *,
    faults: Sequence[str] = CLUSTER_FAULTS,
    jobs: int = 600,
    down_s: float = 10.0,
    sleep_s: float = 0.2,
    concurrency: int = 16,
    commands: dict[str, str] | None = None,
) -> list[Row]:
    """A 3-node cluster (ops/nats/cluster-*.conf, R3 streams) with every connection through a
    loopback proxy (``partition``), three consumer processes on it, and one batch per fault,
    each a run of its own on the same cluster:

    - ``leader kill``: the TASKS stream's leader SIGKILLed, restarted ``down_s`` later;
    - ``follower kill``: a TASKS follower SIGKILLed, restarted ``down_s`` later;
    - ``partition``: the TASKS leader cut off from the other nodes and from its clients by
      the proxies (every byte dropped, no FIN, no reset) for ``down_s``, then healed. One
      consumer is given that node's URL alone (it learns the others from the cluster), so
      the cut catches a consumer, not only a broker.
    """
    import partition
    from nats_configs import wait_healthy

    commands = commands or {}
    nodes = await partition.proxied_cluster(workdir)
    for node in nodes.values():
        node.node.server.start()
    urls = ",".join(node.url for node in nodes.values())
    limits = dataclasses.replace(LIMITS, replicas=3)
    rows = []
    try:
        await wait_healthy([node.node for node in nodes.values()])
        async with session(urls, limits) as js, fake_fleet() as fake:
            topo = Topology()

            async def consumer_led() -> bool:  # an R3 consumer answers once it has a leader
                try:
                    info = await js.consumer_info(topo.tasks_stream, topo.rollout_consumer(AGENT))
                except Exception:  # noqa: BLE001 - not yet
                    return False
                return bool(info.cluster and info.cluster.leader)

            await until(consumer_led, 60, "the agent's consumer has a leader")
            exec_log = workdir / "executions.log"
            first = ChaosRun(js, workdir, exec_log=exec_log, run="cluster-0")
            pool = ConsumerPool(
                first, urls, [fake.url], extra=("--concurrency", str(concurrency), *CONSUMER_FLAGS)
            )
            if "partition" in faults:  # one consumer reaches the cluster through the node cut
                leader = (await patiently(lambda: js.stream_info(topo.tasks_stream))).cluster
                pool.urls[0] = nodes[leader.leader].url
            try:
                for slot in range(3):
                    pool.start(slot)
                await registered(js, pool)
                for i, fault in enumerate(faults):
                    run = ChaosRun(js, workdir, exec_log=exec_log, run=f"cluster-{i}")
                    keys = range(i * jobs, (i + 1) * jobs)
                    rows.append(
                        await _cluster_fault(
                            js,
                            nodes,
                            run,
                            fault,
                            keys,
                            down_s=down_s,
                            sleep_s=sleep_s,
                            command=commands.get(fault, ""),
                        )
                    )
                await registered(js, pool)
            finally:
                codes = await pool.stop()
            assert all(code == 0 for code in codes), codes
    finally:
        await partition.close(nodes)
    return rows


async def cluster_whole(js, topo: Topology) -> bool:
    """The fault is over once the cluster is whole again: the TASKS and TRAJECTORIES streams and
    the agent's consumer each have a leader and every replica is current. Until then leaders
    may still change (a healed node's stale term, a restarted node catching up), and work that
    such a change catches in flight is the fault's doing."""
    try:
        infos = [
            await js.stream_info(topo.tasks_stream),
            await js.stream_info(topo.trajectories_stream),
            await js.consumer_info(topo.tasks_stream, topo.rollout_consumer(AGENT)),
        ]
    except Exception:  # noqa: BLE001 - not answering yet: not whole
        return False
    return all(
        info.cluster
        and info.cluster.leader
        and len(info.cluster.replicas or []) == 2
        and all(r.current and not r.offline for r in info.cluster.replicas or [])
        for info in infos
    )


async def _cluster_fault(
    js,
    nodes,
    run: ChaosRun,
    fault: str,
    keys: range,
    *,
    down_s: float,
    sleep_s: float,
    command: str,
) -> Row:
    import partition

    topo = run.topo
    info = await patiently(lambda: js.stream_info(topo.tasks_stream))
    leader = info.cluster.leader
    followers = [r.name for r in info.cluster.replicas or []]
    await run.publish(keys, sleep_s=sleep_s)
    stored0 = (await patiently(lambda: js.stream_info(topo.trajectories_stream))).state.messages

    async def some_stored() -> bool:
        stored = (await js.stream_info(topo.trajectories_stream)).state.messages
        return stored - stored0 >= len(keys) // 4

    await until(some_stored, 60, "a quarter of the batch stored")
    if fault == "partition":
        with run.fault(f"{leader} (TASKS leader) cut off for {down_s:g} s"):
            partition.cut(nodes, leader)
            await asyncio.sleep(down_s)  # the partition's length is the point
            dropped = partition.dropped(nodes)
            partition.heal(nodes)
            await until(lambda: cluster_whole(js, topo), 120, "the cluster whole again")
        assert dropped > 0, "the proxies dropped nothing: the node was not cut off"
        scenario = f"3-node cluster: the TASKS leader cut off by a proxy for {down_s:g} s, healed"
    else:
        victim = leader if fault == "leader kill" else followers[0]
        role = "leader" if fault == "leader kill" else "follower"
        server = nodes[victim].node.server
        with run.fault(f"{victim} (TASKS {role}) SIGKILL, restart"):
            server.kill()
            await asyncio.sleep(down_s)  # the outage's length is the point
            await asyncio.to_thread(server.start)
            await until(lambda: cluster_whole(js, topo), 120, "the cluster whole again")
        scenario = f"3-node cluster: TASKS {role} SIGKILLed, restarted after {down_s:g} s"
    await run.wait_settled(180 + len(keys) / 20)
    return await run.tally(scenario, command=command)


async def disk_full(
    workdir: Path,
    *,
    size_mb: int = 8,
    jobs: int = 3000,
    pad: int = 2000,
    full_s: float = 10.0,
    concurrency: int = 16,
    command: str = "",
) -> Row:
    """A real full disk: the broker's store on a ``size_mb`` tmpfs (root only: ``mount -t
    tmpfs``). Jobs carry ``pad`` bytes so trajectories fill it. nats-server 2.9 then answers no
    write (the clients' requests time out; at its own store limit, 75 % of the disk at start, it
    would answer "insufficient resources"). Consumers must hold their jobs for ``full_s``; then
    the operator grows the volume and restarts the broker (nats-server sizes its store at start),
    and everything lands."""
    mount = workdir / "tmpfs"
    mount.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mount)], check=True
    )
    server = NatsServer(store_dir=mount / "nats", log_file=workdir / "nats-server.log")
    try:
        server.start()
        # JetStream reserves a stream's max_bytes from the store: keep the bounded ones small
        limits = dataclasses.replace(LIMITS, tasks_max_bytes=1 << 20, metrics_max_bytes=1 << 20)
        async with consumers_on(server.url, workdir, concurrency, limits=limits) as (js, run, pool):
            try:
                pool.start(0)
                await registered(js, pool)
                publishing = asyncio.create_task(run.publish(range(jobs), pad=pad))
                try:

                    async def full() -> bool:  # the broker may not answer now: ask the disk
                        disk = os.statvfs(mount)
                        return disk.f_bavail * disk.f_frsize < 64 * 1024

                    await until(full, 180, "the disk full")
                    with run.fault(
                        f"disk full ({size_mb} MB tmpfs) for {full_s:g} s, grown, restarted"
                    ):
                        await asyncio.sleep(full_s)  # held past the ack wait: the point
                        subprocess.run(
                            ["mount", "-o", f"remount,size={size_mb * 8}m", str(mount)],
                            check=True,
                        )
                        await asyncio.to_thread(server.stop)
                        await asyncio.to_thread(server.start)
                    await asyncio.wait_for(publishing, 300)
                finally:
                    publishing.cancel()  # on failure: a producer waiting on a dead broker
                await run.wait_settled(300)
                await registered(js, pool)
            finally:
                codes = await pool.stop()
            assert codes == [0], codes
            return await run.tally(
                f"disk full: store on a {size_mb} MB tmpfs, writes refused for {full_s:g} s, "
                "volume grown and broker restarted",
                command=command,
            )
    finally:
        server.stop()
        subprocess.run(["umount", "-l", str(mount)], check=False)
