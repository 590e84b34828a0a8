"""Weights from the trainer to serving engines: stream vs object store vs shared path, one run.

A ~515 MB Qwen2-shaped model (random weights, 8 layers of width 1024) is the trainer's; local
engines serve the same architecture as ``agentarium engine`` subprocesses. Each repeat sends
one new version by each path, in an order that rotates from repeat to repeat, and times it
from the trainer's publish call until every engine serves the version:

- stream: ``WeightStreamer.stream`` — rank 0 of a gloo group broadcasts each tensor to the
  engines (pause → /update_weights_from_distributed → continue); no file. The trainer's publish
  call then also stores the version in the object store for the syncer's fallback: that time
  is printed too, but the engines serve the version before it starts;
- object store: ``WeightStore.publish`` (save_pretrained, sha256, chunks into the object store,
  policy KV), then the syncer (``WeightSyncer.apply``): stream the object to local disk with
  its sha256, pause → /update_weights_from_disk → continue;
- shared path: ``WeightStore.publish`` into a shared directory, then the syncer with
  ``--shared-path``: verify the file's sha256 in place and reload from it.

Every version is checked afterwards: each engine's ``/weights_checksum`` equals the trainer's.
Figures: median and range over ``--repeat`` repeats (the box is shared and noisy).

    python bench/weights_publish.py [--repeat 5] [--engines 1] [--layers 8] [--pin]

``--pin`` runs the trainer (this process) on CPU 0 and the engines on CPU 1 (``taskset``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from agentarium.broker import NatsServer, NatsSettings, Topology, provision
from agentarium.broker.telemetry import setup_logging
from agentarium.inference import weights_checksum
from agentarium.inference.sync import SyncConfig, WeightSyncer
from agentarium.tiny import MODEL_CONFIG, resolve_model
from agentarium.trainer import weight_group
from agentarium.trainer.weight_stream import StreamConfig, WeightStreamer
from agentarium.trainer.weights import WeightStore

MB = 1024 * 1024
ROOT = Path(__file__).resolve().parents[1]
PATHS = ("stream", "object store", "shared path")


def build_big_model(out: Path, tiny: Path, layers: int) -> None:
    """A Qwen2 model of width 1024 with the tiny tokenizer: ~67 MB of float32 per layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **{
            **MODEL_CONFIG,
            "hidden_size": 1024,
            "intermediate_size": 4096,
            "num_hidden_layers": layers,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
        }
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, out / name)


def start_engines(model_dir: Path, count: int, pin: bool) -> list[tuple[subprocess.Popen, str]]:
    prefix = ["taskset", "-c", "1"] if pin else []
    procs = [
        subprocess.Popen(
            [*prefix, sys.executable, "-m", "agentarium", "engine"]
            + ["--model", str(model_dir), "--port", "0", "--threads", "1"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
        )
        for _ in range(count)
    ]
    engines = []
    for proc in procs:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("engine ready on"):
            raise SystemExit(f"engine did not start: {line!r}")
        engines.append((proc, line.split(" on ", 1)[1].strip()))
    return engines


async def checksums(http: aiohttp.ClientSession, urls: list[str]) -> list[tuple[str, str]]:
    out = []
    for url in urls:
        async with http.get(url + "/weights_checksum") as resp:
            data = await resp.json()
        out.append((data["checksum"], data["weight_version"]))
    return out


async def run(args: argparse.Namespace, work: Path) -> None:
    from transformers import AutoModelForCausalLM

    tiny = resolve_model("tiny")
    big = work / "big-model"
    build_big_model(big, tiny, args.layers)
    model = AutoModelForCausalLM.from_pretrained(big, dtype=torch.float32)
    size = sum(t.numel() * t.element_size() for _, t in weight_group.streamable(model))
    engines = start_engines(big, args.engines, args.pin)
    urls = [url for _, url in engines]
    with NatsServer(store_dir=work / "nats") as server:
        nc = await NatsSettings(url=server.url).connect(name="bench-weights")
        js = nc.jetstream()
        topology = Topology()
        await provision(js, topology)
        obj = WeightStore(js, topology, keep_versions=2)
        shared = WeightStore(js, topology, weights_dir=work / "shared", keep_versions=2)
        streamer = WeightStreamer(StreamConfig(engines=tuple(urls), timeout_s=120), run="bench")
        obj_sync = WeightSyncer(
            js, SyncConfig(run="bench", engines=tuple(urls), weights_dir=work / "local"),
            topology=topology,
        )  # fmt: skip
        shared_sync = WeightSyncer(
            js,
            SyncConfig(run="bench-shared", engines=tuple(urls), weights_dir=work / "local2",
                       shared_path=True),
            topology=topology,
        )  # fmt: skip
        times: dict[str, list[float]] = {}
        version = 0

        def record(key: str, seconds: float) -> None:
            times.setdefault(key, []).append(seconds)

        async def send(path: str) -> None:
            nonlocal version
            version += 1
            with torch.no_grad():  # new weights each time, as after an optimizer step
                for p in model.parameters():
                    p.add_(1e-4)
            started = time.perf_counter()
            if path == "stream":
                tensors = weight_group.streamable(model)
                result = await streamer.stream(tensors, version)
                assert result.ok, result
                serving = time.perf_counter() - started
                record("stream: broadcast", result.broadcast_s)
                await obj.publish(model, run="bench", version=version)
                record(
                    "stream: publish call incl. object-store copy", time.perf_counter() - started
                )
                expected = weights_checksum(tensors)[0]
            else:
                store, syncer = (obj, obj_sync) if path == "object store" else (shared, shared_sync)
                update = await store.publish(model, run=syncer.config.run, version=version)
                published = time.perf_counter() - started
                result = await syncer.apply(update)
                assert result.ok, str(result)
                serving = time.perf_counter() - started
                record(f"{path}: publish", published)
                record(f"{path}: fetch + sha256", result.fetch_s)
                expected = weights_checksum(weight_group.streamable(model))[0]
            record(f"{path}: publish to serving", serving)
            for checksum, served in await checksums(http, urls):
                assert (checksum, served) == (expected, str(version)), (path, served)

        try:
            async with aiohttp.ClientSession() as http:
                await send("stream")  # warm-up: builds the group, faults the receive buffers
                times.clear()
                for repeat in range(args.repeat):
                    shift = repeat % len(PATHS)
                    for path in PATHS[shift:] + PATHS[:shift]:
                        await send(path)
        finally:
            await streamer.close()
            await obj_sync.close()
            await shared_sync.close()
            await nc.close()
            for proc, _ in engines:
                proc.terminate()
            for proc, _ in engines:
                proc.wait()
    report(times, size, args)


def report(times: dict[str, list[float]], size: int, args: argparse.Namespace) -> None:
    def cell(key: str) -> str:
        values = times[key]
        return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"

    print(
        f"\n{size / MB:.0f} MB float32, {args.engines} engine(s), {args.repeat} alternated "
        f"repeats{', pinned' if args.pin else ''}: seconds, median (min-max)"
    )
    for key in times:
        print(f"  {key:<48}{cell(key)}")
    base = statistics.median(times["shared path: publish to serving"])
    for path in PATHS:
        mine = statistics.median(times[f"{path}: publish to serving"])
        print(f"  {path} publish to serving vs shared path: {base / mine:.2f}x")


async def main(args: argparse.Namespace) -> None:
    setup_logging("warning")  # logs on stderr; figures alone on stdout
    torch.set_num_threads(1)
    if args.pin:
        os.sched_setaffinity(0, {0})
    with tempfile.TemporaryDirectory(prefix="agentarium-bench-weights-") as tmp:
        await run(args, Path(tmp))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5, help="versions sent by each path")
    parser.add_argument("--engines", type=int, default=1, help="local engines served")
    parser.add_argument("--layers", type=int, default=8, help="model layers (~67 MB each)")
    parser.add_argument("--pin", action="store_true", help="trainer on CPU 0, engines on CPU 1")
    asyncio.run(main(parser.parse_args()))
