"""Weight publishing (object store and shared path), fetching with sha256 checks, pruning, and
the weight syncer against the real local engine and a fake SGLang."""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import time
from pathlib import Path

import aiohttp
import pytest
import torch
from fake_sglang import FakeSGLang
from safetensors.torch import save_file

from agentarium.commands.sync_cmd import add_sync_arguments, config_from_args
from agentarium.inference import (
    WEIGHTS_FILE,
    WeightNotFound,
    WeightVerificationError,
    engine_versions,
    sha256_file,
    verify_file,
)
from agentarium.inference.sync import SyncConfig, WeightSyncer
from agentarium.schemas import WeightIdentity
from agentarium.trainer.weights import WeightStore

PROMPT = list(b"<|im_start|>user\n7+5=")  # byte-level: token id == byte value


def state(seed: int, rows: int = 256) -> dict[str, torch.Tensor]:
    """A small state dict (~300 KB): several 64 KiB chunks at the chunk size used below."""
    gen = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 256, generator=gen), "b": torch.randn(256, generator=gen)}


async def wait_for(predicate, timeout_s: float = 60.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not await predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> Path:
    return tiny_dir


# ---- publish and fetch -----------------------------------------------------------------------


async def test_publish_fetch_round_trip(js, topology, tiny, tmp_path):
    store = WeightStore(js, topology, chunk_size=64 * 1024)
    update = await store.publish(tiny, run="r1", version=1, step=10)
    sha, size = sha256_file(tiny / WEIGHTS_FILE)
    assert (update.run, update.version, update.step, update.object) == ("r1", 1, 10, "r1/v1")
    assert (update.sha256, update.size, update.format) == (sha, size, "safetensors")

    # the policy KV holds the WeightUpdate as JSON
    raw = (await (await js.key_value(topology.policy_bucket)).get("r1")).value
    assert raw.startswith(b"{") and json.loads(raw)["sha256"] == sha
    assert await store.latest("r1") == update

    # chunked at the size asked; the object store's own digest is base64url, not our hex
    obs = await js.object_store(topology.weights_bucket)
    info = await obs.get_info("r1/v1")
    assert info.chunks == -(-size // (64 * 1024)) > 10
    assert info.digest == "SHA-256=" + base64.urlsafe_b64encode(bytes.fromhex(sha)).decode()

    path = await store.fetch(update, tmp_path / "dest")
    assert path == tmp_path / "dest" / WEIGHTS_FILE
    assert path.read_bytes() == (tiny / WEIGHTS_FILE).read_bytes()
    assert sorted(p.name for p in path.parent.iterdir()) == [WEIGHTS_FILE]
    assert await store.fetch(update, tmp_path / "dest") == path  # kept: nothing downloaded
    assert store.fetched == 1


async def test_corrupted_object_fails_verification(js, topology, tmp_path):
    store = WeightStore(js, topology, chunk_size=64 * 1024)
    update = await store.publish(state(1), run="bad", version=1)
    # the object under the update's name now holds other bytes (same size)
    other = tmp_path / "other.safetensors"
    save_file(state(2), str(other), metadata={"format": "pt"})
    obs = await js.object_store(topology.weights_bucket)
    await obs.put("bad/v1", other.read_bytes())
    assert other.stat().st_size == update.size

    dest = tmp_path / "dest"
    with pytest.raises(WeightVerificationError, match="fail verification"):
        await store.fetch(update, dest)
    assert list(dest.iterdir()) == []  # nothing half-written or unverified is left


async def test_pruning_keeps_the_newest_k(js, topology, tmp_path):
    store = WeightStore(js, topology, keep_versions=2)
    updates = [await store.publish(state(v, rows=8), run="p", version=v) for v in range(1, 5)]
    await store.publish(state(9, rows=8), run="other-run", version=1)
    assert await store.versions("p") == [3, 4]
    assert await store.versions("other-run") == [1]  # other runs are not touched
    assert store.pruned == 2
    with pytest.raises(WeightNotFound, match="pruned"):
        await store.fetch(updates[0], tmp_path / "v1")
    await store.fetch(updates[3], tmp_path / "v4")


async def test_run_publisher_is_the_trainer_loops_publisher(js, topology):
    publisher = WeightStore(js, topology).for_run("loop")
    assert await publisher.latest_version() is None
    update = await publisher.publish(state(1, rows=8), 4, 40)
    assert (update.run, update.version, update.step) == ("loop", 4, 40)
    assert await publisher.latest_version() == 4


async def test_shared_path_mode(js, topology, tiny, tmp_path):
    shared = tmp_path / "shared"
    store = WeightStore(js, topology, weights_dir=shared, keep_versions=2)
    updates = [await store.publish(tiny, run="sp", version=v) for v in (1, 2, 3)]
    file = shared / "sp" / "v3" / WEIGHTS_FILE
    assert updates[-1].object == str(file) and file.is_file()
    assert updates[-1].sha256 == sha256_file(tiny / WEIGHTS_FILE)[0]
    assert sorted(p.name for p in (shared / "sp").iterdir()) == ["v2", "v3"]  # pruned, no stage
    assert await store.latest("sp") == updates[-1]
    assert await WeightStore(js, topology).versions("sp") == []  # nothing went through NATS

    copied = await store.fetch(updates[-1], tmp_path / "local")
    assert copied.read_bytes() == file.read_bytes()
    verify_file(file, updates[-1])
    with file.open("r+b") as f:  # flip one byte on the shared disk
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(WeightVerificationError):
        verify_file(file, updates[-1])
    with pytest.raises(WeightVerificationError):
        await store.fetch(updates[-1], tmp_path / "local2")
    assert not (tmp_path / "local2" / WEIGHTS_FILE).exists()


# ---- the syncer ----------------------------------------------------------------------------------


async def test_syncer_drives_sglang_pause_update_continue(js, topology, fake, tmp_path):
    ahead = FakeSGLang(weight_version="sg@5:" + "0" * 16)  # a newer version of this run
    await ahead.start()
    try:
        store = WeightStore(js, topology)
        v3 = str(WeightIdentity.of(await store.publish(state(3), run="sg", version=3, step=30)))
        assert v3.startswith("sg@3:")
        read_back = ["b", "w"]  # the first and last name, for a state dict of no known model
        config = SyncConfig(run="sg", engines=(fake.url, ahead.url), weights_dir=tmp_path / "w")
        syncer = WeightSyncer(js, config, topology=topology)
        result = await syncer.sync_once()

        local = tmp_path / "w" / "sg" / "v3"
        assert fake.control == [
            ("/pause_generation", {"mode": "in_place"}),
            (
                "/update_weights_from_disk",
                {
                    "model_path": str(local),
                    "load_format": None,
                    "weight_version": v3,
                    "flush_cache": True,
                    "abort_all_requests": False,
                },
            ),
            ("/continue_generation", {}),
            # delivery is verified: a read-back of three parameters against the file
            *[("/get_weights_by_name", {"name": n, "truncate_size": 2}) for n in read_back],
        ]
        assert fake.weight_version == v3 and not fake.paused
        assert ahead.control == []  # an engine at a newer version is left alone
        assert result.ok and [r.status for r in result.engines] == ["updated", "skipped"]
        assert (local / WEIGHTS_FILE).is_file()
        # what each engine serves now is on the wire, for live views (agentarium dashboard)
        recorded = {e["engine"]: e for e in await engine_versions(js, topology)}
        assert {u: (e["weight_version"], e["status"]) for u, e in recorded.items()} == {
            fake.url: (v3, "updated"),
            ahead.url: ("sg@5:" + "0" * 16, "skipped"),
        }
        assert {e["run"] for e in recorded.values()} == {"sg"}

        # a failed update still continues generation, and is reported
        fake.update_failures = 1
        update = await store.publish(state(4), run="sg", version=4)
        result = await syncer.apply(update)
        assert [p for p, _ in fake.control[3 + len(read_back) :]] == [
            "/pause_generation",
            "/update_weights_from_disk",
            "/continue_generation",
        ]
        assert not fake.paused and fake.weight_version == v3
        assert not result.ok and result.engines[0].status == "failed"
        assert "scripted update failure" in result.engines[0].message
        (failed,) = [e for e in await engine_versions(js, topology) if e["engine"] == fake.url]
        assert (failed["weight_version"], failed["target_version"], failed["status"]) == (
            v3,
            4,
            "failed",
        )
        await syncer.close()
    finally:
        await ahead.close()


async def test_syncer_shared_path_loads_in_place_or_copies(js, topology, fake, tmp_path):
    shared = tmp_path / "shared"
    await WeightStore(js, topology, weights_dir=shared).publish(state(1), run="sh", version=1)
    in_place = SyncConfig(
        run="sh", engines=(fake.url,), weights_dir=tmp_path / "w", shared_path=True
    )
    result = await WeightSyncer(js, in_place, topology=topology).sync_once()
    assert result.ok and result.model_path == str(shared / "sh" / "v1")
    assert not (tmp_path / "w").exists()  # nothing copied

    fake.weight_version = "default"  # the engine restarted: copy this time
    copying = SyncConfig(run="sh", engines=(fake.url,), weights_dir=tmp_path / "w")
    result = await WeightSyncer(js, copying, topology=topology).sync_once()
    assert result.ok and result.model_path == str(tmp_path / "w" / "sh" / "v1")
    assert fake.weight_version == result.identity and result.identity.startswith("sh@1:")


async def test_syncer_follows_the_watch_across_a_broker_restart(
    nats_server, settings, nc, js, topology, fake, tmp_path
):
    store = WeightStore(nc.jetstream(timeout=1.0), topology)  # short retries after the restart
    await store.publish(state(1, rows=8), run="w", version=1)  # the initial value
    syncer_nc = await settings.connect(name="syncer")
    config = SyncConfig(
        run="w", engines=(fake.url,), weights_dir=tmp_path / "w", keep=2, recheck_s=0.3
    )
    syncer = WeightSyncer(syncer_nc.jetstream(), config, topology=topology)
    task = asyncio.create_task(syncer.run())
    try:

        async def at(version: str):
            return fake.weight_version.startswith(f"w@{version}:")

        await wait_for(lambda: at("1"), 30, "version 1")
        await store.publish(state(2, rows=8), run="w", version=2)
        await wait_for(lambda: at("2"), 30, "version 2 through the watch")

        nats_server.stop()
        nats_server.start()
        for attempt in range(100):  # the test's own client reconnects first
            try:
                await store.publish(state(3, rows=8), run="w", version=3)
                break
            except Exception:
                assert attempt < 99
                await asyncio.sleep(0.2)
        await wait_for(lambda: at("3"), 30, "version 3 after the restart")
        await store.publish(state(4, rows=8), run="w", version=4)
        await wait_for(lambda: at("4"), 30, "version 4")

        async def pruned():  # the syncer prunes right after the engines report the update
            return sorted(p.name for p in (tmp_path / "w" / "w").iterdir()) == ["v3", "v4"]

        await wait_for(pruned, 10, "local copies pruned to the newest two")
        updates = [body for path, body in fake.control if path == "/update_weights_from_disk"]
        assert [b["weight_version"].split(":")[0] for b in updates] == [f"w@{v}" for v in "1234"]
    finally:
        syncer.stop()
        await asyncio.wait_for(task, 30)
        await syncer_nc.close()
    assert not fake.paused


def test_sync_flags_have_help_and_validate(tmp_path):
    parser = argparse.ArgumentParser()
    add_sync_arguments(parser)
    assert all(a.help for a in parser._actions if a.dest != "help")
    args = parser.parse_args(
        ["--run", "r", "--engine", "http://a:1", "--engine", "http://b:2", "--weights-dir", "d"]
    )
    config = config_from_args(args)
    assert config.engines == ("http://a:1", "http://b:2") and config.weights_dir.is_absolute()
    assert (config.keep, config.pause_mode, config.shared_path) == (2, "in_place", False)
    with pytest.raises(ValueError, match="http"):
        config_from_args(parser.parse_args(["--run", "r", "--engine", "a:1"]))
    with pytest.raises(ValueError, match="not a valid name"):
        config_from_args(parser.parse_args(["--run", "r.x", "--engine", "http://a:1"]))


# ---- the weight round trip through the real local engine -----------------------------------------


def log_softmax_of(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # (T, V)
    return torch.log_softmax(logits.float(), dim=-1)


async def test_weight_round_trip_through_the_local_engine(js, topology, tiny, engine_url, tmp_path):
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    trained = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    with torch.no_grad():  # a visibly different policy
        for name, param in trained.named_parameters():
            if "mlp" in name or "lm_head" in name:
                param.mul_(4.0)

    config = SyncConfig(run="rt", engines=(engine_url,), weights_dir=tmp_path / "w", recheck_s=1)
    syncer = WeightSyncer(js, config, topology=topology)
    task = asyncio.create_task(syncer.run())
    async with aiohttp.ClientSession(base_url=engine_url) as http:

        async def model_info() -> dict:
            async with http.get("/model_info") as resp:
                return await resp.json()

        async def serves_v1() -> bool:
            return (await model_info())["weight_version"].startswith("rt@1:")

        try:
            assert (await model_info())["weight_version"] == "default"
            update = await WeightStore(js, topology).publish(trained, run="rt", version=1, step=7)
            await wait_for(serves_v1, 60, "the engine to serve version 1")
        finally:
            syncer.stop()
            await asyncio.wait_for(task, 30)
        assert syncer.last_result.engines[0].status == "updated"
        assert (await model_info())["model_path"] == str(tmp_path / "w" / "rt" / "v1")
        assert sha256_file(tmp_path / "w" / "rt" / "v1" / WEIGHTS_FILE)[0] == update.sha256

        body = {
            "input_ids": PROMPT,
            "sampling_params": {"max_new_tokens": 16, "temperature": 1.0, "sampling_seed": 5},
            "return_logprob": True,
        }
        async with http.post("/generate", json=body) as resp:
            assert resp.status == 200
            out = await resp.json()
    assert out["meta_info"]["weight_version"] == str(WeightIdentity.of(update))
    ids = PROMPT + out["output_ids"]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    positions = range(len(PROMPT) - 1, len(ids) - 1)
    want = log_softmax_of(trained, ids)[list(positions), out["output_ids"]]
    # Both fp32, the engine's cached decode against transformers' whole sequence: other
    # summation orders only. First order each of the 15 matmuls adds ~sqrt(K) u sum|w x|
    # (u = 2**-24, K <= 256: 16 u; Higham and Mary's probabilistic bound); the 4x MLP and head
    # raise sum|w x| to 79.7 over the 15 (measured with hooks on these ids), so two
    # computations and log-softmax's factor 2: 2 * 2 * 16 * 6e-8 * 79.7 = 3.1e-4. 1e-3 leaves
    # 3x (measured 1.4e-6, both kernel sets); the reload moves them by > 0.1 (below).
    assert torch.allclose(got, want, rtol=0, atol=1e-3), (got - want).abs().max()
    before = log_softmax_of(original, ids)[list(positions), out["output_ids"]]
    assert (got - before).abs().max() > 0.1  # the reload really changed the policy
