"""LoRA vs full fine-tuning on the weight path: bytes per update and publish -> serving time.

The trainer side is this process: a ``LocalUpdater`` of the model (full fine-tuning) and one
with ``--lora-rank`` adapters; one ``agentarium engine`` subprocess serves the model. Each
repeat publishes a new version of each kind, in alternating order, through the object store
(``WeightStore.publish``: save, sha256, chunks, policy KV) and hands it to the engine with the
weight syncer (``WeightSyncer.apply``: fetch and verify, then pause -> update_weights_from_disk
-> continue for whole weights, pause -> unload/load_lora_adapter -> update_weight_version ->
continue for an adapter), timed from the publish call until the engine serves the version;
its ``/model_info`` weight_version is checked after each. Version numbers grow across both
kinds (one engine serves both runs). Figures: bytes per update, and seconds, median (min-max).

The model: ``--model tiny`` (the built-in model, 1.4 MB of weights), ``--model smol``
(SmolLM2-135M-Instruct, 538 MB of fp32 weights, its output head tied to its input embedding)
or ``--synthetic WIDTH:LAYERS`` (a random Qwen2 of that shape with the tiny tokenizer, built in
code). The adapters: every linear layer (all-linear) unless ``--lora-target-modules`` names
them; ``--demo-targets`` takes the demo's (every linear layer and the output head).

    PYTHONPATH=. python bench/lora_publish.py [--model smol | --synthetic 1024:8] \
        [--lora-rank 16] [--demo-targets] [--repeat 5]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

import torch

from agentarium.broker import NatsServer, NatsSettings, Topology, provision
from agentarium.broker.telemetry import setup_logging
from agentarium.inference import EngineControl
from agentarium.inference.sync import SyncConfig, WeightSyncer
from agentarium.tiny import resolve_model
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.step import LocalUpdater
from agentarium.trainer.weights import WeightStore

MB = 1024 * 1024


def nudge(updater: LocalUpdater, step: int) -> None:
    """A new version: every trainable weight moves a little, as a step moves it."""
    torch.manual_seed(step)
    with torch.no_grad():
        for p in updater.model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 1e-3)


async def run(args: argparse.Namespace, work: Path) -> dict[str, dict[str, list[float]]]:
    from bench.fsdp_memory import build_synthetic
    from bench.weights_publish import start_engines

    model_dir = resolve_model(args.model)
    if args.synthetic:
        width, layers = (int(x) for x in args.synthetic.split(":"))
        model_dir = work / "model"
        build_synthetic(model_dir, resolve_model("tiny"), width, layers)
    common = dict(agent="a", model_dir=str(model_dir), lr=1e-4)
    updaters = {
        "full": LocalUpdater(TrainerConfig(run="bench-full", **common)),
        "lora": LocalUpdater(
            TrainerConfig(
                run="bench-lora",
                lora_rank=args.lora_rank,
                lora_alpha=args.lora_rank * 2,
                lora_target_modules=tuple(args.lora_target_modules or ("all-linear",)),
                **common,
            )
        ),
    }
    ((engine, url),) = start_engines(model_dir, 1, pin=False)
    control = EngineControl()
    out: dict[str, dict[str, list[float]]] = {k: {"bytes": [], "seconds": []} for k in updaters}
    try:
        with NatsServer(store_dir=work / "nats") as server:
            nc = await NatsSettings(url=server.url).connect(name="bench-lora")
            js = nc.jetstream()
            topology = Topology()
            await provision(js, topology)
            store = WeightStore(js, topology, keep_versions=2)
            syncers = {
                kind: WeightSyncer(
                    js,
                    SyncConfig(run=f"bench-{kind}", engines=(url,), weights_dir=work / kind),
                    topology=topology,
                )
                for kind in updaters
            }
            version = 0
            for repeat in range(args.repeat):
                order = list(updaters) if repeat % 2 == 0 else list(reversed(updaters))
                for kind in order:
                    version += 1
                    nudge(updaters[kind], version)
                    started = time.perf_counter()
                    update = await store.publish(
                        updaters[kind].publishable_model(), run=f"bench-{kind}", version=version
                    )
                    result = await syncers[kind].apply(update)
                    seconds = time.perf_counter() - started
                    assert result.ok, result
                    served = await control.weight_version(url)
                    assert served == str(version), (kind, served, version)
                    out[kind]["bytes"].append(update.size)
                    out[kind]["seconds"].append(seconds)
            for syncer in syncers.values():
                await syncer.close()
            await nc.close()
    finally:
        await control.close()
        engine.terminate()
        engine.wait(timeout=30)
    return out


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


async def main(args: argparse.Namespace) -> None:
    setup_logging("warning")
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="agentarium-bench-lora-") as tmp:
        out = await run(args, Path(tmp))
    model = f"synthetic Qwen2 {args.synthetic}" if args.synthetic else args.model
    targets = ", ".join(args.lora_target_modules or ("all linear layers",))
    print(f"model: {model}; LoRA rank {args.lora_rank} on {targets}; {args.repeat} versions each")
    print("| | bytes per update | publish -> serving, s |")
    print("|---|---|---|")
    for kind, figures in out.items():
        size = statistics.median(figures["bytes"])
        print(f"| {kind} | {size / MB:.3f} MB | {cell(figures['seconds'])} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--synthetic", default="", metavar="WIDTH:LAYERS")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument(
        "--lora-target-modules",
        action="append",
        metavar="NAME",
        help="repeatable (the trainer's); default all-linear; --demo-targets for the demo's",
    )
    parser.add_argument(
        "--demo-targets",
        action="store_true",
        help="the targets of `agentarium demo --lora-rank`: every linear layer and lm_head",
    )
    parser.add_argument("--repeat", type=int, default=5)
    parsed = parser.parse_args()
    if parsed.demo_targets:
        from agentarium.demo.run import LORA_TARGETS

        parsed.lora_target_modules = list(LORA_TARGETS)
    asyncio.run(main(parsed))
