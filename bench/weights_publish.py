"""Weight broadcast: publish, fetch and reload time, object store vs shared path, side by side.

For the tiny model and for a ~515 MB Qwen2-shaped model (random weights, 8 layers of width
1024), each policy version goes the way the trainer and the syncer send it:

- publish: ``WeightStore.publish(model)`` — save_pretrained to one safetensors file, sha256,
  then the object store (chunked) or the shared directory, then the policy KV;
- fetch: the syncer's side — stream the object into a local file and verify its sha256; in
  shared-path mode either verify the trainer's file in place (``--shared-path``) or copy it
  to local disk while hashing;
- reload: pause → ``/update_weights_from_disk`` → continue on a running local engine (the
  model's tensors are copied into the live module).

An extra row times nats-py's own ``ObjectStore.get(writeinto=file)``, the alternative a user
would reach for, against our streaming fetch. Each figure is the best of ``--repeat`` runs
(the box is shared, so the minimum is the least noisy estimate).

    python bench/weights_publish.py [--repeat 2] [--big-layers 8] [--no-big]
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import aiohttp
import torch

from agentarium.tiny import MODEL_CONFIG, resolve_model
from broker import NatsServer, NatsSettings, Topology, provision
from broker.telemetry import setup_logging
from consumers.engine import LocalEngine, start_server
from trainer.sync import reload_engine
from trainer.weights import WeightStore, verify_file

MB = 1024 * 1024


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


async def bench_case(js, topology, model_dir: Path, work: Path, repeat: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    engine = LocalEngine(model_dir, threads=1, max_batch=4)
    server = await start_server(engine, "127.0.0.1", 0)
    obj = WeightStore(js, topology, keep_versions=2)
    shared = WeightStore(js, topology, weights_dir=work / "shared", keep_versions=2)
    times: dict[str, list[float]] = {}

    def record(key: str, seconds: float) -> None:
        times.setdefault(key, []).append(seconds)

    async def reload(http, path: Path, version: int) -> float:
        started = time.perf_counter()
        ok, message = await reload_engine(
            http, server.url, model_path=str(path), weight_version=str(version)
        )
        assert ok, message
        return time.perf_counter() - started

    version = 0
    try:
        async with aiohttp.ClientSession() as http:
            for _ in range(repeat):
                with tempfile.TemporaryDirectory(dir=work) as scratch:
                    started = time.perf_counter()
                    await asyncio.to_thread(model.save_pretrained, scratch)
                    record("save", time.perf_counter() - started)
                version += 1
                run = f"bench-{model_dir.name}"
                started = time.perf_counter()
                update = await obj.publish(model, run=run, version=version)
                record("obj publish", time.perf_counter() - started)
                dest = work / "local" / f"v{version}"
                started = time.perf_counter()
                await obj.fetch(update, dest)
                record("obj fetch", time.perf_counter() - started)
                record("obj reload", await reload(http, dest, version))
                size = update.size

                nats_out = work / "nats-get.bin"
                obs = await js.object_store(topology.weights_bucket)
                started = time.perf_counter()
                with open(nats_out, "wb") as f:
                    await obs.get(update.object, writeinto=f)
                record("nats get", time.perf_counter() - started)
                nats_out.unlink()
                shutil.rmtree(dest)

                version += 1
                started = time.perf_counter()
                update = await shared.publish(model, run=run, version=version)
                record("shared publish", time.perf_counter() - started)
                started = time.perf_counter()
                await asyncio.to_thread(verify_file, update.object, update)
                record("shared verify", time.perf_counter() - started)
                record("shared reload", await reload(http, Path(update.object).parent, version))
                copy_dest = work / "copy" / f"v{version}"
                started = time.perf_counter()
                await shared.fetch(update, copy_dest)
                record("shared copy", time.perf_counter() - started)
                shutil.rmtree(copy_dest)
    finally:
        await server.close()
    best = {k: min(v) for k, v in times.items()}
    best["size_mb"] = size / MB
    return best


def report(name: str, t: dict) -> None:
    def row(label: str, left: float | None, right: float, note: str = "") -> None:
        left_text = "" if left is None else f"{left:.3f}"
        print(f"{label:<34}{left_text:>14}{right:>14.3f}{note}")

    print(f"\n{name}: {t['size_mb']:.1f} MB safetensors")
    print(f"{'seconds':<34}{'object store':>14}{'shared path':>14}")
    row("publish (save + store + KV)", t["obj publish"], t["shared publish"])
    row("  of which save_pretrained", t["save"], t["save"])
    row("fetch + sha256 (syncer)", t["obj fetch"], t["shared verify"], "  (in place)")
    row("", None, t["shared copy"], "  (copied locally)")
    row("reload (pause/update/continue)", t["obj reload"], t["shared reload"])
    total_obj = t["obj publish"] + t["obj fetch"] + t["obj reload"]
    total_shared = t["shared publish"] + t["shared verify"] + t["shared reload"]
    row("total, publish to serving", total_obj, total_shared)
    rate = t["size_mb"] / t["obj fetch"]
    print(
        f"object store fetch: ours {t['obj fetch']:.2f} s ({rate:.0f} MB/s) vs nats-py "
        f"get(writeinto) {t['nats get']:.2f} s ({t['size_mb'] / t['nats get']:.0f} MB/s)"
    )


async def main(args: argparse.Namespace) -> None:
    setup_logging("warning")  # logs on stderr; figures alone on stdout
    torch.set_num_threads(1)
    tiny = resolve_model("tiny")
    with tempfile.TemporaryDirectory(prefix="agentarium-bench-weights-") as tmp:
        work = Path(tmp)
        with NatsServer(store_dir=work / "nats") as server:
            nc = await NatsSettings(url=server.url).connect(name="bench-weights")
            try:
                js = nc.jetstream()
                topology = Topology()
                await provision(js, topology)
                cases = [("tiny model", tiny)]
                if not args.no_big:
                    big = work / "big-model"
                    build_big_model(big, tiny, args.big_layers)
                    cases.append((f"Qwen2 width 1024 x {args.big_layers} layers", big))
                for name, model_dir in cases:
                    case_dir = work / f"case-{model_dir.name}"
                    case_dir.mkdir()
                    report(name, await bench_case(js, topology, model_dir, case_dir, args.repeat))
            finally:
                await nc.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=2, help="runs per figure; best is shown")
    parser.add_argument(
        "--big-layers", type=int, default=8, help="layers of the big model (~67 MB each)"
    )
    parser.add_argument("--no-big", action="store_true", help="only the tiny model")
    asyncio.run(main(parser.parse_args()))
