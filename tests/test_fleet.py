"""An LLM fleet outage against a real nats-server and fake SGLang servers that stop and hang:
in-flight rollouts are held (no attempt spent, deadlines paused), pulling pauses, a hung
server is found by its health probe in seconds, a dead server of two is skipped, and only an
outage past its limit turns into errors."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest
from fake_sglang import FakeSGLang, dead_url
from prometheus_client import REGISTRY
from structlog.testing import capture_logs
from worker_env import tiny_template

from agentarium.broker import collect_status, format_status, live_workers
from agentarium.consumers import (
    ConsumerService,
    ConsumerSettings,
    ConsumerSpec,
    Fleet,
    FleetPolicy,
    LLMTarget,
)
from agentarium.consumers.backends import GenerateRequest, SGLangBackend
from agentarium.consumers.errors import BackendUnavailable
from agentarium.producers import TaskProducer, TrajectoryReader

# Probed fast, so an outage of a few seconds is seen within a fraction of one.
FAST = dict(probe_interval_s=0.2, probe_timeout_s=0.3, backoff_s=0.1, max_backoff_s=0.4)


async def two_calls(task: dict, llm) -> float:
    for turn in range(2):
        await llm.chat([{"role": "user", "content": f"{task['task_id']} turn {turn}"}])
    return 1.0


def consumer(js, topology, urls: list[str], *, limit_s: float = 60.0, **spec) -> ConsumerService:
    consumer = dict(
        concurrency=16,
        ack_wait_s=3.0,  # the outages below last longer: heartbeats keep the held jobs
        fetch_timeout_s=0.2,
        retry_delay_s=0.05,
        llm_retries=1,
        burst=True,
        fleet_outage_limit_s=limit_s,
        **{f"fleet_{k}": v for k, v in FAST.items()},
        worker_id="fleet-test",
    )
    options: dict = dict(
        agent="steady",
        fn=two_calls,
        target=LLMTarget(urls=tuple(urls)),
        model_dir=None,
        model_name="tiny",
    )
    for key, value in spec.items():
        (options if key in ConsumerSpec.__dataclass_fields__ else consumer)[key] = value
    options["settings"] = ConsumerSettings.of(**consumer)
    return ConsumerService(js, topology, ConsumerSpec(**options), template=tiny_template())


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> float:
    """Seconds until ``condition()`` holds (checked every 20 ms), failing after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            raise AssertionError(f"not within {timeout}s")
        await asyncio.sleep(0.02)
    return time.monotonic() - start


async def registry_fleet(js, topology) -> dict:
    workers = await live_workers(js, topology)
    return workers[0].get("fleet", {}) if workers else {}


def fleet_up_gauge() -> float | None:
    return REGISTRY.get_sample_value("agentarium_llm_fleet_up", {"agent": "steady", "fleet": "llm"})


async def test_fleet_down_mid_batch_holds_every_job_and_loses_nothing(js, topology):
    fake = FakeSGLang()
    await fake.start()
    producer = TaskProducer(js, topology)
    first = await producer.submit(
        "steady", [{"task_id": f"a{i}"} for i in range(8)], run="outage", deadline_s=2.0
    )
    service = consumer(js, topology, [fake.url])
    outages = REGISTRY.get_sample_value(
        "agentarium_llm_fleet_outages_total", {"agent": "steady", "fleet": "llm"}
    )
    try:
        with capture_logs() as logs:
            await service.start()
            [fleet] = service.fleets
            worker = service.worker
            await fake.wait_for_requests(6)  # mid-batch: rollouts in flight
            await fake.stop()
            await until(lambda: worker.paused)  # a fetch under way when it went down is over
            assert fleet.holding
            # Jobs published during the outage wait in the queue: with free slots and
            # nothing else to do, the worker still takes none of them.
            second = await producer.submit(
                "steady", [{"task_id": f"b{i}"} for i in range(8)], run="outage", deadline_s=2.0
            )
            fetched = worker.counters.fetched
            await until(lambda: fleet_up_gauge() == 0.0)
            shown = {}

            async def registry_says_down() -> None:
                while (await registry_fleet(js, topology)).get("state") != "down":
                    await asyncio.sleep(0.05)
                shown["status"] = format_status(await collect_status(js, topology))

            await asyncio.wait_for(registry_says_down(), 5)
            # The outage lasts longer than the jobs' deadline (2 s) and their ack wait (3 s).
            await asyncio.sleep(3.5)
            assert worker.counters.fetched == fetched <= 8
            info = await js.consumer_info(
                topology.tasks_stream, topology.rollout_consumer("steady")
            )
            assert info.num_pending == 16 - fetched and info.num_redelivered == 0
            await fake.start()
            counters = await asyncio.wait_for(service.wait(), 30)
    finally:
        await service.stop()
        await fake.close()

    assert (counters.ok, counters.errors, counters.timeouts) == (16, 0, 0)
    assert (counters.dead_lettered, counters.retried, counters.failed) == (0, 0, 0)
    trajectories = await TrajectoryReader(js, topology).read("outage")
    assert sorted(t.job_id for t in trajectories) == sorted(first.job_ids + second.job_ids)
    assert all(t.status == "ok" and t.attempts == 1 for t in trajectories)  # no attempt spent
    assert (await js.stream_info(topology.dead_stream)).state.messages == 0
    info = await js.consumer_info(topology.tasks_stream, topology.rollout_consumer("steady"))
    assert info.num_redelivered == 0  # heartbeats kept every held job
    # Logged once per state change, with the outage's length.
    downs = [e for e in logs if e["event"] == "fleet_down"]
    ups = [e for e in logs if e["event"] == "fleet_up"]
    assert len(downs) == 1 and len(ups) == 1 and downs[0]["log_level"] == "warning"
    assert 3.5 <= ups[0]["down_s"] < 10
    assert "LLM fleet down on 1 of 1 worker(s)" in shown["status"]
    assert "llm=DOWN" in shown["status"] and "(1/1 servers down)" in shown["status"]
    assert fleet_up_gauge() == 1.0
    assert (
        REGISTRY.get_sample_value(
            "agentarium_llm_fleet_outages_total", {"agent": "steady", "fleet": "llm"}
        )
        == (outages or 0) + 1
    )


async def test_a_hung_server_is_found_by_its_probe_within_seconds(js, topology):
    """It accepts every request and never answers: the 600 s request timeout would hold each
    call for ten minutes; the probe's 0.3 s timeout finds it."""
    fake = FakeSGLang()
    await fake.start()
    await TaskProducer(js, topology).submit(
        "steady", [{"task_id": f"h{i}"} for i in range(6)], run="hung"
    )
    service = consumer(js, topology, [fake.url], concurrency=3, llm_timeout_s=600.0)
    try:
        with capture_logs() as logs:
            await service.start()
            [fleet] = service.fleets
            await fake.wait_for_requests(2)
            fake.hang()
            found_in = await until(lambda: fleet.holding)
            fake.unhang()
            counters = await asyncio.wait_for(service.wait(), 30)
    finally:
        await service.stop()
        await fake.close()
    assert found_in < 3.0
    assert "/health" in fake.hung  # the probe saw it hang
    assert (counters.ok, counters.errors, counters.dead_lettered) == (6, 0, 0)
    [down] = [e for e in logs if e["event"] == "llm_server_down"]
    assert "within 0.3s" in down["error"]
    trajectories = await TrajectoryReader(js, topology).read("hung")
    assert all(t.status == "ok" and t.attempts == 1 for t in trajectories)


async def test_one_hung_server_of_two_is_skipped_and_its_calls_fail_over(js, topology):
    live, hung = FakeSGLang(), FakeSGLang()
    for server in (live, hung):
        await server.start()
    await TaskProducer(js, topology).submit(
        "steady", [{"task_id": f"s{i}"} for i in range(24)], run="half"
    )
    service = consumer(js, topology, [live.url, hung.url], concurrency=8)
    try:
        with capture_logs() as logs:
            await service.start()
            [fleet] = service.fleets
            await hung.wait_for_requests(2)
            hung.hang()
            await until(lambda: fleet.backend.balancer.is_held(hung.url))
            stuck = hung.hung.count("/generate")  # cut off by the breaker, re-served by live
            counters = await asyncio.wait_for(service.wait(), 30)
            assert not fleet.down
    finally:
        await service.stop()
        for server in (live, hung):
            await server.close()
    assert (counters.ok, counters.errors, counters.dead_lettered) == (24, 0, 0)
    assert hung.hung.count("/generate") == stuck  # nothing sent to it once its breaker opened
    assert not [e for e in logs if e["event"] == "fleet_down"]
    [down] = [e for e in logs if e["event"] == "llm_server_down"]
    assert down["servers_down"] == "1/2"
    assert REGISTRY.get_sample_value("agentarium_llm_server_up", {"backend": hung.url}) == 0.0


async def test_a_dead_server_of_two_is_skipped_without_waiting_for_the_fleet():
    live = FakeSGLang()
    await live.start()
    dead = dead_url()
    fleet = Fleet(
        SGLangBackend([dead, live.url], retries=0, backoff=0.0),
        agent="unit",
        policy=FleetPolicy(**FAST),
    )
    try:
        await fleet.start()
        await until(lambda: fleet.backend.balancer.is_held(dead))
        for i in range(10):  # fresh route keys: without the breaker some would pick the dead one
            request = GenerateRequest(
                input_ids=[1, 2], sampling={"max_new_tokens": 2}, route_key=f"k{i}"
            )
            result = await fleet.generate(request)
            assert result.backend == live.url
        assert fleet.backend.balancer.dispatched[dead] == 0 and not fleet.down
        assert fleet.snapshot() | {"down_for_s": 0.0} == {
            "state": "up",
            "down_for_s": 0.0,
            "past_limit": False,
            "servers": 2,
            "servers_down": 1,
        }
    finally:
        await fleet.aclose()
        await live.close()


async def test_an_outage_past_its_limit_fails_rollouts_as_errors_as_before(js, topology):
    await TaskProducer(js, topology).submit(
        "steady", [{"task_id": f"x{i}"} for i in range(4)], run="gone"
    )
    service = consumer(js, topology, [dead_url()], limit_s=1.0)
    try:
        with capture_logs() as logs:
            await service.start()
            counters = await asyncio.wait_for(service.wait(), 30)
    finally:
        await service.stop()
    assert (counters.errors, counters.failed, counters.ok, counters.dead_lettered) == (4, 4, 0, 0)
    trajectories = await TrajectoryReader(js, topology).read("gone")
    assert all(t.status == "error" and "LLM backend failed" in t.error for t in trajectories)
    events = [e["event"] for e in logs]
    assert events.count("fleet_down") == 1 and events.count("fleet_outage_limit") == 1
    assert events.index("fleet_down") < events.index("fleet_outage_limit")
    [limit] = [e for e in logs if e["event"] == "fleet_outage_limit"]
    assert 1.0 <= limit["down_s"] < 3 and limit["log_level"] == "error"


async def test_a_call_that_fails_while_the_fleet_answers_is_not_held():
    """A failure the probe does not confirm (the server answers /health but fails this
    request) is the request's: an error at once, as without fleet handling."""
    fake = FakeSGLang()
    await fake.start()
    fake.failures = [503, 503]
    fleet = Fleet(
        SGLangBackend([fake.url], retries=1, backoff=0.0), agent="unit", policy=FleetPolicy(**FAST)
    )
    try:
        await fleet.start()
        with pytest.raises(BackendUnavailable, match="HTTP 503"):
            await fleet.generate(GenerateRequest(input_ids=[1], sampling={"max_new_tokens": 1}))
        assert not fleet.down and fleet.outages == 0
    finally:
        await fleet.aclose()
        await fake.close()


def test_fleet_policy_is_checked():
    assert FleetPolicy().holds and not FleetPolicy(outage_limit_s=0).holds
    for bad in (dict(outage_limit_s=-1), dict(probe_timeout_s=0), dict(probe_failures=0)):
        with pytest.raises(ValueError):
            FleetPolicy(**bad)


async def test_a_stream_cut_after_its_first_chunk_is_not_held_and_called_again():
    """A streamed call whose tokens were handed on (the client acted on them) fails at once
    when its server goes, even while the fleet holds calls: calling again would generate the
    reply a second time under the tokens already sent."""
    fake = FakeSGLang()
    await fake.start()
    fake.hold_streams = True  # the stream stops after its first chunk
    fleet = Fleet(
        SGLangBackend([fake.url], retries=0, backoff=0.0), agent="unit", policy=FleetPolicy(**FAST)
    )
    chunks: list = []
    handed = asyncio.Event()

    def on_chunk(chunk) -> None:
        chunks.append(chunk)
        handed.set()

    try:
        await fleet.start()
        request = GenerateRequest(input_ids=[1, 2], sampling={"max_new_tokens": 8}, rid="s")
        call = asyncio.ensure_future(fleet.generate(request, on_chunk=on_chunk))
        await asyncio.wait_for(handed.wait(), 5.0)  # the server then holds the rest
        fake.hang()  # the fleet's probes now find it down: an unstreamed call would be held
        fleet.backend.open_breaker(fake.url)  # ... and the stream in flight is cut
        with pytest.raises(BackendUnavailable):
            await asyncio.wait_for(call, 5.0)
        assert chunks and fake.count == 1
    finally:
        fake.unhang()
        fake.release_streams()
        await fleet.aclose()
        await fake.close()
