"""Prometheus metrics and health probes, scraped over HTTP as Prometheus and Kubernetes would:
a consumer's rollouts and LLM calls, the queue gauges from one collector, the local engine's
/metrics, the trainer after a step, the weight syncer, and the consumer command's --metrics-port."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest
from fake_sglang import FakeSGLang
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from trainlib import one_call_group, publish, served

from agentarium.broker import MetricsServer, MetricsServerError, Topology, collect_stream_metrics
from agentarium.consumers import ConsumerService, ConsumerSettings, ConsumerSpec, LLMTarget
from agentarium.producers import TaskProducer, TrajectoryReader

ROOT = Path(__file__).resolve().parents[1]

Samples = dict[tuple[str, frozenset], float]


async def get(url: str) -> tuple[int, str]:
    async with aiohttp.ClientSession() as http, http.get(url) as resp:
        return resp.status, await resp.text()


async def scrape(base: str) -> Samples:
    status, text = await get(f"{base}/metrics")
    assert status == 200, text
    return parse(text)


def parse(text: str) -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def label_values(samples: Samples) -> set[str]:
    return {v for _, labels in samples for _, v in labels}


async def rollout(task: dict, llm) -> float:
    await llm.chat([{"role": "user", "content": task["prompt"]}], max_new_tokens=4)
    if task.get("sleep"):
        await asyncio.sleep(task["sleep"])  # past the job's deadline: status timeout
    if task.get("fail"):
        raise RuntimeError("the agent failed on purpose")
    return 1.0


# ---- the server itself ----------------------------------------------------------------------------


async def test_health_endpoints_report_each_check_and_a_failed_refresh_still_answers():
    connected = False

    def boom() -> bool:
        raise RuntimeError("no engine loaded")

    async def refresh() -> None:
        raise RuntimeError("broker unreachable")

    server = MetricsServer(0, host="127.0.0.1")
    server.readiness("nats", lambda: connected).on_scrape(refresh)
    async with server:
        assert server.port > 0 and server.url.endswith(f":{server.port}")
        status, body = await get(f"{server.url}/healthz")
        assert (status, json.loads(body)) == (200, {"ok": True, "checks": {}})
        status, body = await get(f"{server.url}/readyz")
        assert (status, json.loads(body)["checks"]) == (503, {"nats": "failing"})
        connected = True
        assert (await get(f"{server.url}/readyz"))[0] == 200

        server.liveness("engine", boom)
        status, body = await get(f"{server.url}/healthz")
        assert status == 503 and "no engine loaded" in json.loads(body)["checks"]["engine"]

        # a failing refresh hook is counted, and the scrape still answers
        first = value(await scrape(server.url), "agentarium_metrics_refresh_errors_total")
        second = value(await scrape(server.url), "agentarium_metrics_refresh_errors_total")
        assert first >= 1 and second == first + 1

        # a taken port is refused with what to do about it
        with pytest.raises(MetricsServerError, match="another --metrics-port, or 0"):
            await MetricsServer(server.port, host="127.0.0.1").start()


# ---- a consumer ---------------------------------------------------------------------------------


async def test_consumer_counts_rollouts_and_llm_calls_by_agent_and_status(js, tiny_dir):
    fake = FakeSGLang(output_ids=[65, 66])
    await fake.start()
    agent = "promtoy"
    spec = ConsumerSpec(
        agent=agent,
        fn=rollout,
        target=LLMTarget(urls=(fake.url,)),
        model_dir=str(tiny_dir),
        model_name="tiny",
        settings=ConsumerSettings.of(
            concurrency=8,
            proxy_host="127.0.0.1",
            attempts=1,  # an agent error is dead-lettered at once
            fetch_timeout_s=0.2,
            drain_grace_s=5.0,
        ),
    )
    service = ConsumerService(js, Topology(), spec)
    server = MetricsServer(0, host="127.0.0.1")
    server.readiness("consumer", lambda: service.ready)
    await server.start()
    try:
        assert (await get(f"{server.url}/readyz"))[0] == 503  # not pulling yet
        await service.start()
        producer = TaskProducer(js)
        ok = await producer.submit(agent, [{"prompt": f"p{i}"} for i in range(3)], run="prom")
        failing = await producer.submit(agent, [{"prompt": "x", "fail": True}], run="prom")
        slow = await producer.submit(
            agent, [{"prompt": "y", "sleep": 30}], run="prom", deadline_s=0.3
        )
        job_ids = ok.job_ids + failing.job_ids + slow.job_ids
        stored = list((await TrajectoryReader(js).wait_for("prom", job_ids, timeout=60)).values())
        assert sorted(t.status for t in stored) == ["error", "ok", "ok", "ok", "timeout"]
        assert (await get(f"{server.url}/readyz"))[0] == 200
        await service.stop()  # in-flight jobs settle (acks, the dead letter) before it returns
        assert (await get(f"{server.url}/readyz"))[0] == 503  # drained

        samples = await scrape(server.url)
    finally:
        await service.stop()
        await server.close()
        await fake.close()

    assert value(samples, "agentarium_rollouts_total", agent=agent, status="ok") == 3
    assert value(samples, "agentarium_rollouts_total", agent=agent, status="timeout") == 1
    assert value(samples, "agentarium_rollouts_total", agent=agent, status="agent_error") == 1
    assert (
        value(samples, "agentarium_rollout_duration_seconds_count", agent=agent, status="ok") == 3
    )
    assert value(samples, "agentarium_dead_letters_total", agent=agent, reason="agent_error") == 1
    assert value(samples, "agentarium_rollouts_in_flight", agent=agent) == 0
    # the consumer watched its event loop's lag while it ran (one sample every 50 ms)
    assert value(samples, "agentarium_event_loop_lag_seconds_count") > 0

    backend = fake.url  # the server that answered, as configured
    assert (
        value(samples, "agentarium_llm_requests_total", backend=backend, finish_reason="stop") == 5
    )
    assert value(samples, "agentarium_llm_request_duration_seconds_count", backend=backend) == 5
    assert value(samples, "agentarium_llm_completion_tokens_total", backend=backend) == 5 * 2
    prompt_tokens = sum(len(r["input_ids"]) for r in fake.requests)
    assert value(samples, "agentarium_llm_prompt_tokens_total", backend=backend) == prompt_tokens

    # bounded labels only: no job, group or batch id anywhere in the exposition
    ids = set(job_ids) | {t.group_id for t in stored} | {ok.batch_id, failing.batch_id}
    assert not ids & label_values(samples)
    assert not any(i in name for i in ids for name, _ in samples)


# ---- the queue gauges: one collector ---------------------------------------------------------------


async def test_queue_gauges_come_from_one_collector_over_broker_status(js, topology):
    producer = TaskProducer(js)
    await producer.submit("waiting-agent", [{"n": i} for i in range(3)], run="q")
    registry = CollectorRegistry()
    async with MetricsServer(0, host="127.0.0.1", registry=registry) as server:
        streams = collect_stream_metrics(js, topology, server, min_interval_s=0)
        samples = await scrape(server.url)
        assert value(samples, "agentarium_queue_waiting_jobs", agent="waiting-agent") == 3
        assert value(samples, "agentarium_tasks_stream_messages") == 3
        assert value(samples, "agentarium_workers", agent="waiting-agent") == 0
        assert streams.status is not None and streams.status.agents[0].agent == "waiting-agent"
        with pytest.raises(ValueError, match="once per process"):
            collect_stream_metrics(js, topology, server)

        # an agent that leaves the broker leaves no stale series behind
        await js.purge_stream(topology.tasks_stream)
        samples = await scrape(server.url)
        assert ("agentarium_queue_waiting_jobs", frozenset({("agent", "waiting-agent")})) not in (
            samples
        )
        assert value(samples, "agentarium_tasks_stream_messages") == 0


# ---- the local engine ----------------------------------------------------------------------------------


async def test_engine_serves_its_own_metrics(engine_url):
    body = {"input_ids": [72, 105], "sampling_params": {"max_new_tokens": 3, "temperature": 1.0}}
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{engine_url}/generate", json=body) as resp:
            out = await resp.json()
            assert resp.status == 200, out
    generated = out["meta_info"]["completion_tokens"]
    samples = await scrape(engine_url)
    finish = out["meta_info"]["finish_reason"]["type"]
    assert value(samples, "agentarium_engine_requests_total", finish_reason=finish) >= 1
    assert value(samples, "agentarium_engine_prompt_tokens_total") >= 2
    assert value(samples, "agentarium_engine_generated_tokens_total") >= generated
    assert value(samples, "agentarium_engine_request_duration_seconds_count") >= 1
    assert value(samples, "agentarium_engine_running_sequences") == 0
    assert value(samples, "agentarium_engine_weight_version") == 0  # "default"


# ---- the trainer ------------------------------------------------------------------------------------------


async def test_trainer_exports_its_step_reward_and_stale_drops(js, topology, tiny_dir, tmp_path):
    import torch

    from agentarium.trainer.config import TrainerConfig
    from agentarium.trainer.loop import Trainer

    torch.set_num_threads(1)
    run, agent = "prom-train", "toy"
    for g, version in enumerate(
        ["default", "default", served(run, 3), served(run, 3)]
    ):  # 2 too stale
        group = one_call_group(
            g,
            run=run,
            agent=agent,
            job_id=lambda g, i: f"pj{g}-{i}",
            group_id=f"pg{g}",
            reward=lambda g, i: float(i == 0),
            version=version,
        )
        await publish(js, topology, group)

    class Publisher:
        async def publish(self, model, version: int, step: int) -> None:
            pass

        async def latest_version(self) -> int:
            return 3

    config = TrainerConfig(
        run=run,
        agent=agent,
        model_dir=str(tiny_dir),
        group_size=4,
        groups_per_step=2,
        max_staleness=1,
    )
    trainer = Trainer(config, js, topology=topology, publisher=Publisher())
    server = MetricsServer(0, host="127.0.0.1").readiness("trainer", lambda: trainer.ready)
    async with server:
        assert (await get(f"{server.url}/readyz"))[0] == 503  # still loading
        summary = await trainer.run(max_steps=1)
        samples = await scrape(server.url)
    assert summary.steps == 1
    assert value(samples, "agentarium_trainer_step", run=run) == 1
    assert value(samples, "agentarium_trainer_steps_total", run=run) == 1
    assert value(samples, "agentarium_trainer_policy_version", run=run) == 3
    assert value(samples, "agentarium_trainer_reward_mean", run=run) == 0.25
    assert value(samples, "agentarium_trainer_trajectories_total", run=run) == 8
    assert (
        value(samples, "agentarium_trainer_dropped_trajectories_total", run=run, reason="stale")
        == 8
    )
    # the trained groups were sampled by the current version: 0 versions behind
    assert value(samples, "agentarium_trainer_staleness_versions_count", run=run) == 8
    assert value(samples, "agentarium_trainer_staleness_versions_bucket", run=run, le="0.0") == 8
    assert value(samples, "agentarium_trainer_publish_duration_seconds_count", run=run) == 1
    assert value(samples, "agentarium_trainer_step_duration_seconds_count", run=run) == 1


# ---- the weight syncer ----------------------------------------------------------------------------------


async def test_syncer_exports_each_engines_weight_version_and_reload_times(js, topology, tmp_path):
    import torch

    from agentarium.inference.sync import SyncConfig, WeightSyncer
    from agentarium.trainer.weights import WeightStore

    behind, ahead = FakeSGLang(), FakeSGLang(weight_version="prom-sync@5:" + "ab" * 8)
    await behind.start()
    await ahead.start()
    try:
        await WeightStore(js, topology).publish(
            {"w": torch.zeros(4, 4)}, run="prom-sync", version=3
        )
        config = SyncConfig(
            run="prom-sync", engines=(behind.url, ahead.url), weights_dir=tmp_path / "w"
        )
        result = await WeightSyncer(js, config, topology=topology).sync_once()
        assert result is not None and [r.status for r in result.engines] == ["updated", "skipped"]
        async with MetricsServer(0, host="127.0.0.1") as server:
            samples = await scrape(server.url)
    finally:
        await behind.close()
        await ahead.close()
    run = "prom-sync"
    assert value(samples, "agentarium_sync_published_version", run=run) == 3
    assert value(samples, "agentarium_sync_engine_weight_version", run=run, engine=behind.url) == 3
    assert value(samples, "agentarium_sync_engine_weight_version", run=run, engine=ahead.url) == 5
    reloads = "agentarium_sync_reloads_total"
    assert value(samples, reloads, run=run, engine=behind.url, result="updated") == 1
    assert value(samples, reloads, run=run, engine=ahead.url, result="updated") == 0
    assert value(samples, "agentarium_sync_fetch_duration_seconds_count", run=run) == 1
    assert (
        value(samples, "agentarium_sync_reload_duration_seconds_count", run=run, engine=behind.url)
        == 1
    )


# ---- the consumer command ------------------------------------------------------------------------------------


async def test_consumer_command_serves_metrics_and_probes_on_metrics_port(nats_url, js, tiny_dir):
    fake = FakeSGLang()
    await fake.start()
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}",
        "AGENTARIUM_NATS_URL": nats_url,
        "AGENTARIUM_LOG_FORMAT": "json",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "agentarium",
        "consumer",
        "--agent",
        "cli-prom=test_prometheus:rollout",
        "--llm",
        fake.url,
        "--model",
        str(tiny_dir),
        "--metrics-port",
        "0",
        "--metrics-host",
        "127.0.0.1",
        "--proxy-host",
        "127.0.0.1",
        env=env,
        cwd=ROOT,
        stderr=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.DEVNULL,
    )
    try:
        metrics_url = ""
        while True:  # the port it picked is logged; "worker started" means it pulls
            line = await asyncio.wait_for(proc.stderr.readline(), 60)
            assert line, f"the consumer exited early ({await proc.wait()})"
            try:
                event = json.loads(line)
            except ValueError:
                continue  # not a log event (a warning printed by a library)
            if event.get("event") == "metrics listening":
                metrics_url = event["url"].removesuffix("/metrics")
            if event.get("event") == "worker started":
                break
        assert metrics_url
        assert (await get(f"{metrics_url}/readyz"))[0] == 200
        assert (await get(f"{metrics_url}/healthz"))[0] == 200
        result = await TaskProducer(js).submit("cli-prom", [{"prompt": "hi"}], run="cli")
        await TrajectoryReader(js).wait_for("cli", result.job_ids, timeout=60)
        samples = await scrape(metrics_url)
        assert value(samples, "agentarium_rollouts_total", agent="cli-prom", status="ok") == 1
        assert value(samples, "process_resident_memory_bytes") > 0  # the standard collectors
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 30) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        await fake.close()
