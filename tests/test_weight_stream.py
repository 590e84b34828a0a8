"""Weights streamed over torch.distributed (gloo) from the trainer, rank 0, to two real local
engines (``agentarium engine`` subprocesses): both serve the new version with the trainer's
exact weights (compared by hash); an engine restarted between versions rejoins the rebuilt
group; an engine that stalls during the broadcast keeps its old weights, and the syncer then
brings it to the version from the object store."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
import torch
from aiohttp import web

from agentarium.inference import weights_checksum
from agentarium.inference.sync import SyncConfig, WeightSyncer
from agentarium.schemas import WeightIdentity
from agentarium.trainer import weight_group as wg
from agentarium.trainer.weight_stream import StreamConfig, StreamPublisher, WeightStreamer
from agentarium.trainer.weights import WeightStore

PROMPT = list(b"<|im_start|>user\n7+5=")  # byte-level: token id == byte value


class Fleet:
    """Local engines (``agentarium engine`` subprocesses, started together), and one more
    started beside them: ``restart(i)`` stops engine i and puts that fresh process (another
    engine_id, its first weights) in its place, as a restart would without the wait."""

    def __init__(self, model_dir: Path, size: int = 2) -> None:
        self.model_dir = model_dir
        procs = [self._spawn() for _ in range(size + 1)]
        urls = [self._ready(proc) for proc in procs]
        self.procs, self.urls = procs[:size], urls[:size]
        self.spare: tuple[subprocess.Popen, str] | None = (procs[size], urls[size])

    def _spawn(self) -> subprocess.Popen:
        argv = [sys.executable, "-m", "agentarium", "engine", "--model", str(self.model_dir)]
        return subprocess.Popen(
            [*argv, "--port", "0"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=Path(__file__).parents[1],
        )

    @staticmethod
    def _ready(proc: subprocess.Popen) -> str:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # the engine prints one line once it listens, or exits
        if not line.startswith("engine ready on"):
            raise RuntimeError(f"the local engine did not start: {line!r} (exit {proc.poll()})")
        return line.split(" on ", 1)[1].strip()

    def restart(self, slot: int) -> None:
        self._stop([self.procs[slot]])
        if self.spare is None:
            self.spare = (proc := self._spawn()), self._ready(proc)
        (self.procs[slot], self.urls[slot]), self.spare = self.spare, None

    def close(self) -> None:
        self._stop(self.procs + ([self.spare[0]] if self.spare else []))

    @staticmethod
    def _stop(procs: list[subprocess.Popen]) -> None:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


class Proxy:
    """An HTTP hop in front of one engine: the streamer calls it as the engine's URL, so the
    engine behind it can be restarted on another port, and ``stall`` holds the calls to
    one path unanswered, as an engine that stopped responding would."""

    def __init__(self, fleet: Fleet, slot: int) -> None:
        self.fleet, self.slot = fleet, slot
        self.stalled: set[str] = set()
        self.held = 0
        self.url = ""
        self._release = asyncio.Event()

    def unstall(self) -> None:
        """Forward every call again; the held ones answer 503 (their callers left)."""
        self.stalled.clear()
        self._release.set()
        self._release = asyncio.Event()

    async def __aenter__(self) -> Proxy:
        self.http = aiohttp.ClientSession()
        app = web.Application(client_max_size=64 * 1024**2)
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.unstall()
        await self.runner.cleanup()
        await self.http.close()

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        if request.path in self.stalled:
            self.held += 1
            await self._release.wait()
            return web.Response(status=503)
        async with self.http.request(
            request.method,
            self.fleet.urls[self.slot] + request.path_qs,
            data=await request.read(),
            headers={"Content-Type": request.headers.get("Content-Type", "application/json")},
        ) as resp:
            return web.Response(
                body=await resp.read(), status=resp.status, content_type=resp.content_type
            )


@pytest.fixture(scope="module")
def fleet(tiny_dir):
    engines = Fleet(tiny_dir)
    yield engines
    engines.close()


@pytest.fixture
def model(tiny_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)


def train_step(model, seed: int) -> str:
    """Change every weight (as an optimizer step would); the new weights' checksum."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 1e-3)
    return weights_checksum(wg.streamable(model))[0]


async def served(http: aiohttp.ClientSession, url: str) -> tuple[str, str]:
    """(weights checksum, weight_version of a fresh generation) of one engine."""
    async with http.get(url + "/weights_checksum") as resp:
        assert resp.status == 200
        checksum = (await resp.json())["checksum"]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    async with http.post(url + "/generate", json=body) as resp:
        assert resp.status == 200
        version = (await resp.json())["meta_info"]["weight_version"]
    return checksum, version


def publisher(js, topology, engines: list[str], run: str, timeout_s: float = 30.0):
    streamer = WeightStreamer(StreamConfig(engines=tuple(engines), timeout_s=timeout_s), run=run)
    store = WeightStore(js, topology, keep_versions=2)
    return StreamPublisher(streamer, store.for_run(run), js=js, topology=topology), store


def ident(update) -> str:
    """The weight_version engines report for a published version: its identity."""
    return str(WeightIdentity.of(update))


async def test_stream_updates_every_engine_and_a_restarted_one_rejoins(js, topology, fleet, model):
    async with Proxy(fleet, 1) as proxy, aiohttp.ClientSession() as http:
        engines = [fleet.urls[0], proxy.url]
        pub, store = publisher(js, topology, engines, run="s1")
        try:
            expected = train_step(model, seed=1)
            update = u1 = await pub.publish(model, version=1, step=1)
            assert pub.last is not None and pub.last.ok and pub.last.rebuilt
            for url in engines:
                assert await served(http, url) == (expected, ident(u1))
            # the version is recorded as the default path records it: consumers see it
            assert (update.version, (await store.latest("s1")).version) == (1, 1)

            expected = train_step(model, seed=2)
            u2 = await pub.publish(model, version=2, step=2)
            assert pub.last.ok and not pub.last.rebuilt  # the same group, no new rendezvous
            for url in engines:
                assert await served(http, url) == (expected, ident(u2))

            fleet.restart(1)  # a new engine process behind the same URL, on its first weights
            assert (await served(http, proxy.url))[1] == "default"
            expected = train_step(model, seed=3)
            u3 = await pub.publish(model, version=3, step=3)
            assert pub.last.ok and pub.last.rebuilt
            assert [e.before for e in pub.last.engines] == [ident(u2), "default"]
            for url in engines:
                assert await served(http, url) == (expected, ident(u3))
            assert pub.streamer.counters.rebuilt == 2
        finally:
            await pub.close()


async def test_a_stalled_broadcast_is_discarded_and_the_object_store_catches_up(
    js, topology, fleet, model, tmp_path
):
    async with Proxy(fleet, 1) as proxy, aiohttp.ClientSession() as http:
        engines = [fleet.urls[0], proxy.url]
        pub, _ = publisher(js, topology, engines, run="s2", timeout_s=2.0)
        try:
            first = train_step(model, seed=11)
            u1 = await pub.publish(model, version=1, step=1)
            assert pub.last.ok

            # engine 1 stops answering the update: it never receives, the broadcast times out
            proxy.stalled.add("/update_weights_from_distributed")
            second = train_step(model, seed=12)
            update = u2 = await pub.publish(model, version=2, step=2)
            result = pub.last
            assert proxy.held == 1 and not result.ok and proxy.url in result.failed()
            assert "broadcast failed" in dict((e.url, e.message) for e in result.engines)[proxy.url]
            # no engine is half-updated: those the broadcast did not complete keep version 1
            for url in result.failed():
                assert await served(http, url) == (first, ident(u1))
            assert update.version == 2  # stored and recorded all the same

            # the fallback: the syncer fetches version 2 from the object store
            proxy.unstall()
            config = SyncConfig(run="s2", engines=tuple(engines), weights_dir=tmp_path / "w")
            synced = await WeightSyncer(js, config, topology=topology).sync_once()
            assert synced is not None and synced.ok
            for url in engines:
                assert await served(http, url) == (second, ident(u2))

            # and the next version streams again, through a rebuilt group
            third = train_step(model, seed=13)
            u3 = await pub.publish(model, version=3, step=3)
            assert pub.last.ok and pub.last.rebuilt
            for url in engines:
                assert await served(http, url) == (third, ident(u3))
        finally:
            await pub.close()


async def test_trainer_settings_select_the_transport(js, topology, tmp_path):
    from agentarium import trainer
    from agentarium.cli import build_parser
    from agentarium.commands import trainer_cmd

    def publisher_of(*argv: str):
        args = build_parser().parse_args(
            ["trainer", "--run", "r", "--agent", "a", "--model", "tiny", *argv]
        )
        config, process, _ = trainer_cmd.resolve_args(args)
        return process, trainer.publisher_for(config, process)(js, topology, config)

    engines = ("--stream-engine", "http://10.0.0.1:30000", "--stream-engine", "http://e2:30000")
    process, pub = publisher_of("--weight-transport", "stream", *engines, "--stream-timeout", "5")
    assert isinstance(pub, StreamPublisher)
    assert pub.streamer.config == StreamConfig(
        engines=("http://10.0.0.1:30000", "http://e2:30000"), backend="gloo", timeout_s=5.0
    )
    assert pub.store.store.weights_dir is None  # the stored copy goes to the object store
    # the same from a config file, with the stored copy on a shared path
    path = tmp_path / "t.yaml"
    path.write_text(
        f"weight_transport: stream\nstream_engines: [http://127.0.0.1:1]\nweights_dir: {tmp_path}\n"
    )
    _, pub = publisher_of("--config", str(path))
    assert pub.streamer.config.engines == ("http://127.0.0.1:1",)
    assert pub.streamer.config.address() == "127.0.0.1"
    assert pub.store.store.weights_dir == tmp_path
    # as before: --weights-dir alone is the shared path, nothing the object store
    assert publisher_of("--weights-dir", str(tmp_path))[1].store.weights_dir == tmp_path
    assert publisher_of()[1].store.weights_dir is None
    for argv, error in [
        (("--weight-transport", "shared-path"), "writes under --weights-dir"),
        (("--weight-transport", "object-store", "--weights-dir", "d"), "drop it"),
        (engines, "--stream-engine is for --weight-transport stream"),
        (("--weight-transport", "stream"), "at least one --stream-engine"),
    ]:
        with pytest.raises(ValueError, match=error):
            publisher_of(*argv)


async def test_one_flattened_bucket_per_update(fleet, model):
    """SGLang's other format: every tensor's bytes in one uint8 broadcast."""
    config = StreamConfig(engines=tuple(fleet.urls), timeout_s=30.0, bucket=True)
    streamer = WeightStreamer(config, run="s3")
    async with aiohttp.ClientSession() as http:
        try:
            for version, seed in ((7, 21), (8, 22)):
                expected = train_step(model, seed)
                result = await streamer.stream(wg.streamable(model), version)
                assert result.ok, result
                for url in fleet.urls:
                    assert await served(http, url) == (expected, str(version))
        finally:
            await streamer.close()


async def test_the_engine_refuses_what_it_cannot_apply_and_keeps_its_weights(fleet, model):
    url = fleet.urls[0]
    async with aiohttp.ClientSession() as http:

        async def post(path: str, body: dict) -> tuple[int, dict]:
            async with http.post(url + path, json=body) as resp:
                return resp.status, await resp.json()

        update = {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]], "group_name": "nope"}
        status, answer = await post("/update_weights_from_distributed", update)
        assert (status, answer["success"]) == (400, False)
        assert "does not exist" in answer["message"]
        status, answer = await post("/destroy_weights_update_group", {"group_name": "nope"})
        assert (status, answer["success"]) == (400, False)
        init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1,
                "world_size": 2, "group_name": "g", "backend": "nccl"}  # fmt: skip
        status, answer = await post("/init_weights_update_group", init)
        assert status == 400 and "use gloo" in answer["message"]
        status, answer = await post("/update_weights_from_distributed", {**update, "shapes": []})
        assert status == 400 and "differ in length" in answer["error"]["message"]

        # a tensor the model does not have: received (the broadcast completes), then refused,
        # and nothing of that version is served
        before = await served(http, url)
        streamer = WeightStreamer(StreamConfig(engines=(url,), timeout_s=30.0), run="s4")
        try:
            train_step(model, seed=31)
            tensors = [*wg.streamable(model), ("not.a.weight", torch.zeros(3))]
            result = await streamer.stream(tensors, version=99)
            assert not result.ok and "unexpected ['not.a.weight']" in result.engines[0].message
            assert await served(http, url) == before
        finally:
            await streamer.close()
