"""Weights have an identity, not a number (docs/design.md "Weight flow").

An engine's ``weight_version`` is ``run@version:sha16`` (or ``default``, the base weights): a
run's syncer takes over engines that serve another run's weights, or refuses with
``--shared-engines``; it leaves alone an engine another run's live syncer holds; and it
verifies each update, holding an engine that does not serve what it reports out of the
consumers' fleets.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from fake_sglang import FakeSGLang
from prometheus_client import REGISTRY
from safetensors.torch import save_file
from worker_env import tiny_template

from agentarium.consumers import ConsumerService, ConsumerSettings, ConsumerSpec, LLMTarget
from agentarium.inference import engine_versions, record_engine, served_version
from agentarium.inference.sync import SyncConfig, SyncRefused, WeightSyncer
from agentarium.producers import TaskProducer, TrajectoryReader
from agentarium.schemas import SchemaError, WeightIdentity, run_version
from agentarium.trainer.weights import WeightStore


def state(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(16, 32, generator=gen), "b": torch.randn(32, generator=gen)}


def syncer(js, topology, run: str, urls, tmp_path, **kw) -> WeightSyncer:
    config = SyncConfig(run=run, engines=tuple(urls), weights_dir=tmp_path / "w", **kw)
    return WeightSyncer(js, config, topology=topology)


async def records(js, topology, url: str) -> dict[str, dict]:
    """run -> the engines-KV record of ``url`` by that run's syncer."""
    return {e["run"]: e for e in await engine_versions(js, topology) if e["engine"] == url}


def test_an_identity_names_run_version_and_content_and_never_compares_across_runs():
    sha = "0123456789abcdef" * 4
    identity = WeightIdentity.named("A", 31, sha)
    assert str(identity) == "A@31:0123456789abcdef"
    assert WeightIdentity.parse(str(identity)) == identity
    assert WeightIdentity.parse("default") == WeightIdentity.base()
    # a bare number, a server's own label: not something a trainer published
    assert WeightIdentity.parse("31") is None and WeightIdentity.parse("v1.2") is None
    assert run_version(str(identity), "A") == 31
    assert run_version(str(identity), "B") is None  # run A's 31 is not newer than B's 7
    assert run_version("default", "B") == 0
    assert run_version("31", "B") is None and run_version(None, "B") is None
    with pytest.raises(SchemaError):
        WeightIdentity("a.b", 1, "0" * 16)  # a run name that would not parse back
    with pytest.raises(SchemaError):
        WeightIdentity("A", 1, "xyz")


async def test_a_new_run_takes_its_engines_over_and_restores_the_base_first(
    js, topology, fake, tmp_path
):
    base = tmp_path / "base"
    base.mkdir()
    save_file(state(0), str(base / "model.safetensors"))
    store = WeightStore(js, topology)
    a31 = await store.publish(state(1), run="A", version=31)
    result = await syncer(js, topology, "A", [fake.url], tmp_path).sync_once()
    assert result.ok and fake.weight_version == str(WeightIdentity.of(a31))
    assert (await records(js, topology, fake.url))["A"]["live"] is False  # --once holds nothing

    # Run B, nothing published: its version 0 is the base weights, loaded over A's.
    b = syncer(js, topology, "B", [fake.url], tmp_path, base_model=base)
    result = await b.sync_once()
    assert result.ok and result.engines[0].status == "updated", result
    assert fake.weight_version == "default"
    loads = [body for path, body in fake.control if path == "/update_weights_from_disk"]
    assert (loads[-1]["model_path"], loads[-1]["weight_version"]) == (str(base), "default")

    # B publishes version 2, far below A's 31: loaded all the same (no comparison across runs).
    b2 = await store.publish(state(2), run="B", version=2)
    result = await syncer(js, topology, "B", [fake.url], tmp_path).sync_once()
    assert result.ok and fake.weight_version == str(WeightIdentity.of(b2))
    assert (await records(js, topology, fake.url))["B"]["weight_version"] == str(
        WeightIdentity.of(b2)
    )
    # and B's waiters count it, A's do not
    entries = list((await records(js, topology, fake.url)).values())
    assert served_version(entries, "B", now=time.time()) == 2
    assert served_version(entries, "A", now=time.time()) == -1


async def test_base_weights_that_cannot_be_found_are_an_error_naming_the_flag(
    js, topology, fake, tmp_path
):
    fake.weight_version = "A@3:" + "ab" * 8
    result = await syncer(js, topology, "B", [fake.url], tmp_path).sync_once()
    assert not result.ok and "--base-model" in result.engines[0].message
    assert fake.weight_version == "A@3:" + "ab" * 8  # nothing was loaded


async def test_shared_engines_refuse_naming_both_runs(js, topology, fake, tmp_path):
    fake.weight_version = "A@31:" + "ab" * 8
    await WeightStore(js, topology).publish(state(2), run="B", version=2)
    b = syncer(js, topology, "B", [fake.url], tmp_path, shared_engines=True)
    with pytest.raises(SyncRefused, match="run 'A'.*run 'B'"):
        await b.sync_once()
    assert fake.weight_version == "A@31:" + "ab" * 8 and not fake.control


async def test_two_runs_syncers_on_one_engine_do_not_fight(js, topology, fake, tmp_path):
    store = WeightStore(js, topology)
    a1 = await store.publish(state(1), run="A", version=1)
    await store.publish(state(2), run="B", version=1)
    a = syncer(js, topology, "A", [fake.url], tmp_path / "a", recheck_s=0.2)
    running = asyncio.create_task(a.run())
    try:
        while (await records(js, topology, fake.url)).get("A", {}).get("status") != "updated":
            await asyncio.sleep(0.05)
        b = syncer(js, topology, "B", [fake.url], tmp_path / "b")
        result = await b.sync_once()
        assert result.engines[0].status == "conflict" and not result.ok
        assert "run 'A'" in result.engines[0].message
        assert fake.weight_version == str(WeightIdentity.of(a1))  # B loaded nothing
    finally:
        a.stop()
        await asyncio.wait_for(running, 30)
    # A's syncer stopped: its records say so, and B takes the engine over at once.
    assert (await records(js, topology, fake.url))["A"]["live"] is False
    result = await syncer(js, topology, "B", [fake.url], tmp_path / "b").sync_once()
    assert result.ok and fake.weight_version.startswith("B@1:")


def mismatches(run: str, url: str) -> float:
    labels = {"run": run, "engine": url}
    return REGISTRY.get_sample_value("agentarium_sync_mismatch_total", labels) or 0.0


@pytest.mark.parametrize("broken", ["ignores the update", "keeps its weights"])
async def test_an_engine_that_does_not_serve_the_update_is_a_mismatch(
    js, topology, fake, tmp_path, broken
):
    store = WeightStore(js, topology)
    await store.publish(state(1), run="m", version=1)
    assert (await syncer(js, topology, "m", [fake.url], tmp_path).sync_once()).ok
    if broken == "ignores the update":  # answers success, changes nothing
        fake.ignore_updates = True
    else:  # reports the new identity, serves the old weights
        fake.ignore_weights = True
    before = mismatches("m", fake.url)
    v2 = await store.publish(state(2), run="m", version=2)
    result = await syncer(js, topology, "m", [fake.url], tmp_path).sync_once()
    (engine,) = result.engines
    assert engine.status == "mismatch" and not result.ok
    assert str(WeightIdentity.of(v2)) in engine.message
    if broken == "keeps its weights":
        assert "does not serve its weights" in engine.message
    assert mismatches("m", fake.url) == before + 1
    record = (await records(js, topology, fake.url))["m"]
    assert record["status"] == "mismatch"
    # the run's waiters never count it as serving the version
    assert served_version([record], "m", now=time.time()) == -1


async def reply(task: dict, llm) -> float:
    await llm.chat([{"role": "user", "content": task["task_id"]}])
    return 1.0


async def test_consumers_hold_a_mismatched_engine_out_until_it_serves_the_right_weights(
    js, topology, tmp_path
):
    good, bad = FakeSGLang(), FakeSGLang()
    await good.start()
    await bad.start()
    settings = ConsumerSettings.of(
        concurrency=4, fetch_timeout_s=0.2, burst=False, worker_id="holds", llm_retries=1
    )
    spec = ConsumerSpec(
        agent="held",
        fn=reply,
        target=LLMTarget(urls=(good.url, bad.url)),
        model_dir=None,
        model_name="tiny",
        settings=settings,
    )
    service = ConsumerService(js, topology, spec, template=tiny_template())
    producer = TaskProducer(js, topology)
    try:
        await service.start()
        [fleet] = service.fleets

        async def syncer_says(status: str, message: str = "") -> None:  # as run h's syncer
            await record_engine(
                js, topology, run="h", url=bad.url, weight_version="h@2:" + "ab" * 8,
                status=status, target_version=2, message=message,
            )  # fmt: skip

        await syncer_says("mismatch", "reports 'h@2:abab…' but does not serve its weights")
        while bad.url not in fleet._open:  # the watch delivers the record
            await asyncio.sleep(0.02)
        await producer.submit("held", [{"task_id": f"t{i}"} for i in range(12)], run="h")
        while len(await TrajectoryReader(js, topology).read("h")) < 12:
            await asyncio.sleep(0.05)
        assert bad.count == 0 and good.count == 12  # no call went to the engine held out

        await syncer_says("updated")
        while bad.url in fleet._open:  # verified later: back in the fleet
            await asyncio.sleep(0.02)
    finally:
        await service.stop()
        await good.close()
        await bad.close()


def test_a_base_model_that_holds_no_weights_is_refused_naming_the_flag(tmp_path):
    (tmp_path / "empty").mkdir()
    for bad in (tmp_path / "missing", tmp_path / "empty"):
        with pytest.raises(ValueError, match="--base-model"):
            SyncConfig(run="B", engines=("http://127.0.0.1:1",), base_model=bad)
