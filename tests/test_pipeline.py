"""End to end with real processes: nats-server, the local engine (tiny model) and
`agentarium consumer` processes, as a user would run them."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import aiohttp
import pytest

from agentarium.demo.processes import Child, child_env, consumer_argv, start_child
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.tiny import ensure_tiny_model

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


@pytest.fixture(scope="module")
def engine(tmp_path_factory, agentarium_home):
    model = ensure_tiny_model()
    child = start_child(
        "engine",
        ["engine", "--model", str(model), "--port", "0"],
        tmp_path_factory.mktemp("engine-logs"),
        wait_ready=True,
    )
    yield child
    child.terminate()


def consumer(name: str, agent: str, nats_url: str, llm: str, log_dir: Path, *extra: str) -> Child:
    env = child_env(PYTHONPATH=os.pathsep.join([str(TESTS), str(ROOT)]))
    argv = consumer_argv(agent, llm, ensure_tiny_model(), nats_url, *extra)
    return start_child(name, argv, log_dir, env=env)


def slow_consumer(name: str, nats_url: str, engine: Child, log_dir: Path, *extra: str) -> Child:
    """agentlib.slow's consumer with the shortest ack wait: what a killed one held comes back
    within seconds."""
    return consumer(
        name, "slow=agentlib:slow", nats_url, engine.url, log_dir, "--ack-wait", "3", *extra
    )


async def wait_exit(child: Child, timeout: float = 120) -> int:
    return await asyncio.wait_for(asyncio.to_thread(child.proc.wait), timeout)


async def wait_stored(js, topology, run: str, n: int, timeout: float = 120) -> None:
    async def follow():
        seen = set()
        async for traj in TrajectoryReader(js, topology).follow(run):
            seen.add(traj.job_id)
            if len(seen) >= n:
                return

    await asyncio.wait_for(follow(), timeout)


async def stored_count(js, topology) -> int:
    return (await js.stream_info(topology.trajectories_stream)).state.messages


async def test_two_consumer_processes_on_the_local_engine(js, topology, nats_url, engine, tmp_path):
    tasks = [{"task_id": f"t{i}", "prompt": f"repeat {i}", "answer": str(i)} for i in range(8)]
    result = await TaskProducer(js, topology).submit("toy", tasks, run="e2e", group_size=8)
    workers = [
        consumer(
            f"c{i}",
            "toy=agentarium.examples.toy:rollout",
            nats_url,
            engine.url,
            tmp_path,
            "--burst",
            "--concurrency",
            "16",
        )
        for i in range(2)
    ]
    assert [await wait_exit(w) for w in workers] == [0, 0]
    async with aiohttp.ClientSession() as http, http.get(f"{engine.url}/model_info") as resp:
        engine_version = (await resp.json())["weight_version"]
    trajs = await TrajectoryReader(js, topology).read("e2e")
    assert sorted(t.job_id for t in trajs) == sorted(result.job_ids) and len(trajs) == 64
    groups: dict[str, list] = {}
    for t in trajs:
        groups.setdefault(t.group_id, []).append(t)
    assert len(groups) == 8 and all(len(g) == 8 for g in groups.values())
    for t in trajs:
        assert t.status == "ok", t.error
        [call] = t.calls
        assert call.response_ids and len(call.response_logprobs) == len(call.response_ids)
        assert all(lp <= 0 for lp in call.response_logprobs)
        assert call.weight_version == engine_version
    assert await stored_count(js, topology) == 64


async def test_consumer_killed_mid_batch_loses_nothing(js, topology, nats_url, engine, tmp_path):
    tasks = [{"n": i, "sleep": 0.4} for i in range(16)]
    result = await TaskProducer(js, topology).submit("slow", tasks, run="kill")
    first = slow_consumer("victim", nats_url, engine, tmp_path, "--concurrency", "4")
    await wait_stored(js, topology, "kill", 4)
    first.kill()  # SIGKILL: in-flight jobs are neither acked nor released
    assert await stored_count(js, topology) < 16
    second = slow_consumer("rescuer", nats_url, engine, tmp_path, "--burst", "--concurrency", "8")
    assert await wait_exit(second) == 0
    trajs = await TrajectoryReader(js, topology).read("kill")
    assert sorted(t.job_id for t in trajs) == sorted(result.job_ids)
    assert await stored_count(js, topology) == 16  # exactly one per job
    assert all(t.status == "ok" for t in trajs)


async def test_broker_restart_mid_batch(js, topology, nats_server, nats_url, engine, tmp_path):
    producer = TaskProducer(js, topology)
    first = await producer.submit(
        "slow", [{"n": i, "sleep": 0.2} for i in range(20)], run="restart"
    )
    worker = slow_consumer("survivor", nats_url, engine, tmp_path, "--concurrency", "4")
    try:
        await wait_stored(js, topology, "restart", 4)
        nats_server.stop()
        # Publishing while the broker is down: the producer waits and retries by itself.
        second = asyncio.create_task(
            producer.submit(
                "slow", [{"n": 100 + i, "sleep": 0.1} for i in range(10)], run="restart"
            )
        )
        await asyncio.sleep(
            1.0
        )  # keep the broker down for a while: outage length is the point here
        nats_server.start()
        second_result = await asyncio.wait_for(second, 60)
        await wait_stored(js, topology, "restart", 30)
    finally:
        worker.terminate()
    trajs = await TrajectoryReader(js, topology).read("restart")
    assert sorted(t.job_id for t in trajs) == sorted(first.job_ids + second_result.job_ids)
    assert await stored_count(js, topology) == 30
    assert worker.proc.returncode == 0  # SIGTERM drained cleanly
