"""The trajectory collector against a real nats-server: trajectories are published straight to
their per-job subjects, as rollout workers store them."""

from __future__ import annotations

import asyncio
import dataclasses

import nats.js.errors
import pytest
from frozen import frozen
from nats.js.api import AckPolicy, ConsumerConfig
from trainlib import served, short_call

from agentarium.broker import BrokerUnavailable
from agentarium.schemas import Trajectory, encode
from agentarium.trainer.collector import Collector, CollectorConfig
from agentarium.trainer.errors import TrainerConfigError
from agentarium.trainer.groups import BUFFERED, DUPLICATE, REDELIVERED, GroupBuffer, Selection

RUN, AGENT = "r1", "toy"


class FakeClock:
    """Group ages only: the collector's own waits use real time."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def traj(
    job, group, reward=1.0, *, size=4, status="ok", version=0, is_train=True, top_p=1.0
) -> Trajectory:
    """One member; ``version``: the run's version that sampled it (0: the base weights)."""
    call = short_call(weight_version=served(RUN, version), top_p=top_p)
    return Trajectory(
        job_id=job,
        agent=AGENT,
        task_id=group,
        group_id=group,
        group_size=size,
        run=RUN,
        status=status,
        reward=reward if status == "ok" else None,
        is_train=is_train,
        error=None if status == "ok" else "backend down",
        calls=[call],
        trace_id="ab" * 16,
    )


async def publish(js, topology, *trajectories: Trajectory) -> None:
    for t in trajectories:
        await js.publish(topology.trajectory_subject(t.run, t.agent, t.job_id), encode(t))


@pytest.fixture
def clock():
    return FakeClock()


@pytest.fixture
async def make_collector(js, topology, clock):
    made = []

    async def make(*, seen=(), **overrides):
        config = CollectorConfig(
            run=RUN, agent=AGENT, group_timeout_s=60.0, fetch_timeout_s=0.2, **overrides
        )
        collector = Collector(js, topology, config, seen=seen, clock=clock)
        await collector.start()
        made.append(collector)
        return collector

    yield make
    for collector in made:
        await collector.close()


TAKE = Selection(version=0, max_staleness=4)


async def test_groups_released_when_complete_validation_skipped(js, topology, make_collector):
    await publish(js, topology, *(traj(f"a{i}", "ga", float(i % 2)) for i in range(4)))
    await publish(js, topology, *(traj(f"b{i}", "gb") for i in range(3)))  # one member missing
    await publish(js, topology, traj("v0", "gv", is_train=False), traj("v1", "gv", is_train=False))
    # another run and another agent on the same stream never reach this consumer
    other = traj("x0", "gx").__class__(**{**traj("x0", "gx").__dict__, "run": "r2"})
    await publish(js, topology, other)
    collector = await make_collector()
    await collector.wait_received(9)
    groups = await collector.take(1, TAKE, timeout=10)
    assert [g.group_id for g in groups] == ["ga"]
    samples = groups[0].samples
    assert sorted(s.trajectory.job_id for s in samples) == ["a0", "a1", "a2", "a3"]
    assert sorted(s.advantage for s in samples) == pytest.approx(
        [-0.866025] * 2 + [0.866025] * 2, abs=1e-5
    )
    c = collector.counters
    assert (c.received, c.validation_skipped, c.groups_complete, c.groups_used) == (9, 2, 1, 1)
    assert collector.buffer.open_count == 1  # gb waits for its fourth member
    with pytest.raises(TimeoutError):
        await collector.take(1, TAKE, timeout=0.5)

    info = await js.consumer_info(topology.trajectories_stream, "trainer-r1-toy")
    cfg = info.config
    assert cfg.ack_policy == AckPolicy.EXPLICIT and cfg.max_deliver == -1
    assert cfg.filter_subject == "agentarium.trajectories.r1.toy.*"
    assert cfg.ack_wait == 300 and cfg.max_ack_pending == 20_000
    assert info.num_ack_pending == 7  # validation acked; ga and gb held

    await collector.ack(groups)
    info = await js.consumer_info(topology.trajectories_stream, "trainer-r1-toy")
    assert info.num_ack_pending == 3


async def test_timeout_releases_short_groups_and_drops_tiny_ones(
    js, topology, make_collector, clock
):
    collector = await make_collector()
    await publish(js, topology, *(traj(f"s{i}", "short", float(i)) for i in range(3)))
    await publish(js, topology, traj("t0", "tiny"), traj("t1", "tiny", status="error"))
    await collector.wait_received(5)
    with pytest.raises(TimeoutError):
        await collector.take(1, TAKE, timeout=0.3)
    clock.now += 61
    groups = await collector.take(1, TAKE, timeout=10)
    assert groups[0].group_id == "short" and groups[0].timed_out and len(groups[0].samples) == 3
    c = collector.counters
    assert (c.groups_timed_out, c.dropped_incomplete, c.failed_members) == (1, 1, 1)
    # the dropped group was acked at once; a late member of a closed group is acked as late
    await publish(js, topology, traj("s3", "short"))
    await collector.wait_received(6)
    assert collector.counters.late == 1
    # only the used group stays pending, awaiting its checkpoint (the late ack is async:
    # the server state is the only thing to observe, so poll it, bounded)
    assert await ack_pending_becomes(js, topology, 3)
    # what was decided without training goes into the next checkpoint, so a replay after a
    # crash does not judge it again: the dropped group's members and the late one
    assert sorted(collector.take_decided()) == ["s3", "t0", "t1"]
    assert collector.take_decided() == []


async def test_error_and_refused_members_are_out_of_statistics(js, topology, make_collector):
    await publish(
        js,
        topology,
        traj("e0", "g", 1.0, size=5),
        traj("e1", "g", 0.0, size=5),
        traj("e2", "g", 0.0, size=5),
        traj("e3", "g", status="timeout", size=5),
        traj("e4", "g", 1.0, top_p=0.9, size=5),
    )
    collector = await make_collector()
    (group,) = await collector.take(1, TAKE, timeout=10)
    by_job = {s.trajectory.job_id: s.advantage for s in group.samples}
    # statistics over the three ok members only: mean 1/3, std sqrt(1/3)
    assert by_job == pytest.approx({"e0": 1.154700, "e1": -0.577350, "e2": -0.577350}, abs=1e-5)
    assert sorted(group.other_job_ids) == ["e3", "e4"]
    assert (collector.counters.failed_members, collector.counters.refused) == (1, 1)


async def test_stale_members_dropped_or_weighted_and_counted(js, topology, make_collector):
    await publish(
        js,
        topology,
        *(traj(f"d{i}", "mixed", float(i % 2), version=v) for i, v in enumerate([1, 4, 4, 5])),
    )
    await publish(js, topology, *(traj(f"o{i}", "old", float(i % 2), version=0) for i in range(4)))
    collector = await make_collector()
    await collector.wait_received(8)
    # version 5, max staleness 2: "old" (staleness 5) is entirely stale, d0 (4) too
    groups = await collector.take(1, Selection(version=5, max_staleness=2), timeout=10)
    assert [g.group_id for g in groups] == ["mixed"]
    assert sorted(s.trajectory.job_id for s in groups[0].samples) == ["d1", "d2", "d3"]
    assert sorted(groups[0].staleness) == [0, 1, 1, 4]
    c = collector.counters
    assert (c.dropped_stale, c.tis_weighted) == (5, 0)
    assert (c.dropped_stale_groups, c.dropped_groups) == (1, 1)  # "old", every member stale
    assert "d0" in groups[0].other_job_ids


async def test_stale_policy_tis_keeps_stale_members_weighted(js, topology, make_collector):
    await publish(
        js,
        topology,
        *(traj(f"w{i}", "g", float(i % 2), version=v) for i, v in enumerate([0, 3, 3, 3])),
    )
    collector = await make_collector()
    (group,) = await collector.take(
        1, Selection(version=3, max_staleness=1, stale_policy="tis"), timeout=10
    )
    flags = {s.trajectory.job_id: (s.tis, s.staleness) for s in group.samples}
    assert flags == {"w0": (True, 3), "w1": (False, 0), "w2": (False, 0), "w3": (False, 0)}
    assert (collector.counters.tis_weighted, collector.counters.dropped_stale) == (1, 0)


async def test_flat_groups_filtered_when_asked_oldest_first(js, topology, make_collector):
    await publish(js, topology, *(traj(f"n{i}", "new", float(i % 2), version=2) for i in range(4)))
    await publish(js, topology, *(traj(f"f{i}", "flat", 1.0) for i in range(4)))
    await publish(
        js, topology, *(traj(f"p{i}", "older", float(i % 2), version=1) for i in range(4))
    )
    collector = await make_collector()
    await collector.wait_received(12)
    groups = await collector.take(
        2, Selection(version=2, max_staleness=4, filter_flat=True), timeout=10
    )
    assert [g.group_id for g in groups] == ["older", "new"]  # oldest policy version first
    assert collector.counters.dropped_flat == 1


async def test_restart_redelivers_unacked_at_once_and_dedups_trained(js, topology, make_collector):
    await publish(js, topology, *(traj(f"a{i}", "ga", float(i % 2)) for i in range(4)))
    await publish(js, topology, *(traj(f"b{i}", "gb", float(i % 2)) for i in range(4)))
    first = await make_collector()
    used = await first.take(1, TAKE, timeout=10)
    await first.close()  # "killed" after a checkpoint listed group ga, before its acks
    trained = used[0].trained_job_ids
    second = await make_collector(seen=trained)
    (group,) = await second.take(1, TAKE, timeout=10)  # no ack_wait to sit out
    assert group.group_id == "gb"
    assert second.counters.duplicates == 4
    await second.ack([group])
    info = await js.consumer_info(topology.trajectories_stream, "trainer-r1-toy")
    assert info.num_ack_pending == 0 and info.num_pending == 0


async def test_the_one_agent_trainers_old_durable_is_adopted_and_a_foreign_one_refused(
    js, topology, make_collector
):
    stream = topology.trajectories_stream
    await publish(js, topology, *(traj(f"a{i}", "ga", float(i % 2)) for i in range(4)))
    await publish(js, topology, *(traj(f"b{i}", "gb", float(i % 2)) for i in range(4)))
    # a trainer of the previous release consumed and acked group ga on trainer-<run>
    old = ConsumerConfig(
        durable_name="trainer-r1",
        filter_subject=topology.trajectories_filter(RUN, AGENT),
        ack_policy=AckPolicy.EXPLICIT,
    )
    await js.add_consumer(stream, old)
    psub = await js.pull_subscribe_bind("trainer-r1", stream)
    for msg in await psub.fetch(4, timeout=5):
        await msg.ack_sync()
    await psub.unsubscribe()
    collector = await make_collector()
    (group,) = await collector.take(1, TAKE, timeout=10)
    assert group.group_id == "gb" and collector.counters.received == 4  # from its ack floor
    with pytest.raises(nats.js.errors.NotFoundError):
        await js.consumer_info(stream, "trainer-r1")
    await collector.close()

    # a durable of this name filtering another run's and agent's subjects is never reset
    await js.delete_consumer(stream, "trainer-r1-toy")
    foreign = ConsumerConfig(
        durable_name="trainer-r1-toy",
        filter_subject=topology.trajectories_filter("r1-toy", "x"),
        ack_policy=AckPolicy.EXPLICIT,
    )
    await js.add_consumer(stream, foreign)
    with pytest.raises(TrainerConfigError, match="another run and agent share this durable"):
        await make_collector()
    info = await js.consumer_info(stream, "trainer-r1-toy")
    assert info.config.filter_subject == "agentarium.trajectories.r1-toy.x.*"


@pytest.mark.nats_semantics
async def test_a_trainer_started_while_the_broker_does_not_answer_waits_and_keeps_its_floor(
    nc, js, topology, nats_server, clock
):
    """A trainer restarted while the broker is frozen (too loaded to answer in a request's
    timeout, or restarting) starts once it answers, from the ack floor its predecessor left;
    one that never answers is reported in words once the start-up patience is spent."""
    await publish(js, topology, *(traj(f"a{i}", "ga", float(i % 2)) for i in range(4)))
    await publish(js, topology, *(traj(f"b{i}", "gb", float(i % 2)) for i in range(4)))
    config = CollectorConfig(run=RUN, agent=AGENT, group_timeout_s=60.0, fetch_timeout_s=0.2)
    first = Collector(js, topology, config, clock=clock)
    await first.start()
    done = await first.take(1, TAKE, timeout=10)
    await first.ack(done)  # waits for the server: the floor is past this group
    await first.close()

    impatient = nc.jetstream(timeout=0.3)  # each try of a frozen server's request fails fast
    second = Collector(impatient, topology, config, clock=clock)
    with frozen(nats_server.pid):
        starting = asyncio.create_task(second.start())
        await asyncio.sleep(1.0)  # the outage under test: several tries meet it, then it ends
        assert not starting.done()
    await asyncio.wait_for(starting, 30)
    try:
        (group,) = await second.take(1, TAKE, timeout=10)
        assert {group.group_id, done[0].group_id} == {"ga", "gb"}  # the other one, not again
        assert second.counters.received == 4
    finally:
        await second.close()

    never = Collector(impatient, topology, dataclasses.replace(config, start_patience_s=0.5))
    with frozen(nats_server.pid):
        with pytest.raises(BrokerUnavailable, match=r"trainer's consumer: NATS did not answer"):
            await never.start()


def test_buffer_redelivery_replaces_the_handle_and_dedups_after_done():
    buffer = GroupBuffer(group_timeout_s=60)
    t = traj("j0", "g", size=2)
    assert buffer.add(t, "delivery-1", 0.0) == BUFFERED
    assert buffer.add(t, "delivery-2", 1.0) == REDELIVERED
    assert buffer.live_handles() == ["delivery-2"]
    buffer.add(traj("j1", "g", 0.0, size=2), "delivery-3", 1.0)
    (group,), _ = buffer.select(1, Selection(version=0, max_staleness=0))
    assert group.handles == ["delivery-2", "delivery-3"]
    buffer.done([group])
    assert buffer.add(t, "delivery-4", 2.0) == DUPLICATE and buffer.live_handles() == []


async def ack_pending_becomes(js, topology, n: int, timeout: float = 5.0) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        info = await js.consumer_info(topology.trajectories_stream, "trainer-r1-toy")
        if info.num_ack_pending == n or asyncio.get_running_loop().time() > deadline:
            return info.num_ack_pending == n
        await asyncio.sleep(0.02)


def test_groups_of_one_are_dropped_with_a_warning_not_only_a_counter():
    """A producer that published group_size 1 (produce's default is for evaluation): every such
    group is dropped, and the trainer says so as it happens (the first and every 100th), with
    what to change."""
    from structlog.testing import capture_logs

    buffer = GroupBuffer(group_timeout_s=60)
    with capture_logs() as logs:
        for i in range(101):
            buffer.add(traj(f"j{i}", f"g{i}", size=1), f"d{i}", 0.0)
        chosen, dropped = buffer.select(101, Selection(version=0, max_staleness=0))
    assert chosen == [] and len(dropped) == 101
    assert buffer.counters.dropped_small == 101
    warnings = [e for e in logs if e["event"] == "groups too small to train on are dropped"]
    assert [w["dropped_small"] for w in warnings] == [1, 101]
    assert warnings[0]["group_size"] == 1 and "--group-size" in warnings[0]["hint"]


@pytest.mark.parametrize("command", ["trainer", "demo"])
def test_a_group_size_that_cannot_train_is_refused_where_it_is_set(command, tmp_path):
    import subprocess
    import sys

    extra = {
        "trainer": [
            "--run",
            "r",
            "--agent",
            "a",
            "--model",
            "tiny",
            "--nats-url",
            "nats://127.0.0.1:1",
        ],
        "demo": ["--out", str(tmp_path / "demo")],
    }[command]
    result = subprocess.run(
        [sys.executable, "-m", "agentarium", command, "--group-size", "1", *extra],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 2, result.stdout + result.stderr
    assert "--group-size must be >= 2" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "demo").exists()  # refused before anything started
