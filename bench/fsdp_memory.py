"""Replicated data parallel vs FSDP2 (``--parallel fsdp``), per rank: parameter and optimizer
bytes, peak resident memory and step time, at 1, 2 and 4 ranks, in one run.

Each configuration starts its ranks as Ray actors (gloo on the CPU; the trainer's own
``RayDataParallel`` and ``FsdpParallel``, with a measuring method added to their ranks), runs
``--warmup`` steps and then ``--steps`` timed steps of one batch of ``--rows`` toy rows
(``--prompt`` + ``--response`` tokens; the same batch, seeds and settings for every
configuration), and reports, per rank: the bytes its parameters and AdamW state hold
(``trainer.step.memory_of``: a sharded rank counts its shards), its peak RSS (``ru_maxrss``:
torch, transformers and Ray's worker are in it too, ~0.5 GB before any model), and the median
step time seen by the trainer (the driver's ``step`` call: split, every rank's forward and
backward, the reduce, the optimizer step).

``--repeat R`` runs every configuration R times, fresh ranks each time, alternating: within a
repeat the rank counts go in order and replicated and FSDP2 swap places at each one and each
repeat (so neither always runs first on a warmer or quieter machine). The table gives the
median over repeats and the range (min-max) of each repeat's figure: the largest rank's peak
RSS and the median step. The 1-minute load average is read before each configuration.

The model: ``--model tiny`` (the built-in 2-layer model: its 0.4 M parameters are far below the
libraries' own memory), ``--model smol`` (the real small model, SmolLM2-135M-Instruct, built
into $AGENTARIUM_HOME/models/ on first use; 4 replicated ranks of it peaked at ~15.4 GB of RSS
together: run it alone), a model directory (``--model DIR``), or ``--synthetic WIDTH:LAYERS``,
a random Qwen2 of that
shape with the tiny tokenizer, built in code. On a 2-core machine 4 ranks share 2 cores, so step
times at 4 ranks measure contention more than scaling: the memory columns are the point.

    PYTHONPATH=. python bench/fsdp_memory.py [--model tiny|smol|DIR] [--synthetic 512:4]
        [--ranks 1,2,4] [--rows 8] [--steps 3] [--warmup 1] [--repeat 3] [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from agentarium.models import resolve_model
from agentarium.schemas import LLMCall, Trajectory
from agentarium.tiny import MODEL_CONFIG
from agentarium.trainer.batch import Sample, build_rows, collate
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.fsdp import FsdpParallel, _FsdpWorker
from agentarium.trainer.ray_dp import RayDataParallel, _Worker

MB = 1024 * 1024


class _Peak:
    def peak_rss(self) -> int:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


class MeasuredRank(_Peak, _Worker):
    pass


class MeasuredShard(_Peak, _FsdpWorker):
    pass


class Replicated(RayDataParallel):
    worker = MeasuredRank


class Sharded(FsdpParallel):
    worker = MeasuredShard


def build_synthetic(out: Path, tiny: Path, width: int, layers: int) -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    heads = max(width // 64, 1)
    config = Qwen2Config(
        **{
            **MODEL_CONFIG,
            "hidden_size": width,
            "intermediate_size": 4 * width,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": heads,
        }
    )
    config.architectures = ["Qwen2ForCausalLM"]
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(tiny / name, out / name)


def toy_batch(rows: int, prompt: int, response: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    samples = []
    for i in range(rows):
        call = LLMCall(
            prompt_ids=[rng.randrange(vocab) for _ in range(prompt)],
            response_ids=[rng.randrange(vocab) for _ in range(response)],
            response_logprobs=[-5.5] * response,
            finish_reason="stop",
        )
        traj = Trajectory(
            job_id=f"j{i}", agent="a", task_id="t", group_id="g", status="ok", reward=0.0,
            calls=[call],
        )  # fmt: skip
        samples.append(Sample(traj, advantage=(i % 4 - 1.5) / 1.1))
    return collate(build_rows(samples)[0], pad_id=0)


def measure(kind: str, world: int, model_dir: Path, args: argparse.Namespace, batch) -> dict:
    load = os.getloadavg()[0]
    config = TrainerConfig(
        run="bench",
        agent="a",
        model_dir=str(model_dir),
        lr=1e-4,
        parallel="fsdp" if kind == "fsdp" else "replicated",
        ray_workers=world,
        micro_batch_size=args.micro_batch_size,
    )
    started = time.monotonic()
    updater = (Sharded if kind == "fsdp" else Replicated)(config, world)
    ready_s = time.monotonic() - started
    try:
        for step in range(args.warmup):
            updater.step(batch, seed=step)
        times = []
        for step in range(args.steps):
            t0 = time.monotonic()
            updater.step(batch, seed=100 + step)
            times.append(time.monotonic() - t0)
        memory = updater.memory()
        peaks = updater._get([a.peak_rss.remote() for a in updater.actors], "peak")  # type: ignore[union-attr]
    finally:
        updater.close()
    return {
        "kind": kind,
        "ranks": world,
        "params_mb": [round(m["params"] / MB, 2) for m in memory],
        "optimizer_mb": [round(m["optimizer"] / MB, 2) for m in memory],
        "peak_rss_mb": [round(p / MB) for p in peaks],
        "step_s": round(statistics.median(times), 3),
        "step_s_all": [round(t, 3) for t in times],
        "start_s": round(ready_s, 1),
        "load": round(load, 2),
    }


def cell(values: list[float], digits: int) -> str:
    """Median (min-max)."""
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def report(rows: list[dict], model: str, params: int) -> None:
    repeats = max(r["repeat"] for r in rows) + 1
    loads = [r["load"] for r in rows]
    print(
        f"model: {model} ({params / 1e6:.2f} M parameters); {repeats} repeat(s), median "
        f"(min-max); load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print(
        "| ranks | mode | params MB per rank | AdamW MB per rank | peak RSS MB, largest rank | "
        "step s | start s |"
    )
    print("|---|---|---|---|---|---|---|")
    keys = dict.fromkeys((r["ranks"], r["kind"]) for r in rows)
    for ranks, kind in sorted(keys, key=lambda k: (k[0], k[1] != "replicated")):
        same = [r for r in rows if (r["ranks"], r["kind"]) == (ranks, kind)]
        first = same[0]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        print(
            f"| {ranks} | {kind} | {mean(first['params_mb']):.2f} | "
            f"{mean(first['optimizer_mb']):.2f} | "
            f"{cell([max(r['peak_rss_mb']) for r in same], 0)} | "
            f"{cell([r['step_s'] for r in same], 3)} | {cell([r['start_s'] for r in same], 1)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="tiny, smol or a model directory")
    parser.add_argument("--synthetic", default="", metavar="WIDTH:LAYERS")
    parser.add_argument("--ranks", default="1,2,4")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--response", type=int, default=16)
    parser.add_argument("--micro-batch-size", type=int, default=0)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=1, help="runs of every configuration")
    parser.add_argument("--json", default="", help="also write the rows here")
    args = parser.parse_args()
    import ray

    torch.set_num_threads(1)
    ranks = [int(r) for r in args.ranks.split(",")]
    ray.init(num_cpus=max(ranks), include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory(prefix="agentarium-bench-") as tmp:
        model_dir, name = resolve_model(args.model), args.model
        if args.synthetic:
            width, layers = (int(x) for x in args.synthetic.split(":"))
            model_dir, name = Path(tmp) / "model", f"synthetic Qwen2 {width}x{layers}"
            build_synthetic(model_dir, resolve_model("tiny"), width, layers)
        config = json.loads((model_dir / "config.json").read_text())
        batch = toy_batch(args.rows, args.prompt, args.response, int(config["vocab_size"]))
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):  # the count alone: no weights in this process
            shape = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        params = sum(p.numel() for p in shape.parameters())
        rows, turn = [], 0
        for repeat in range(args.repeat):
            for w in ranks:
                kinds = ("replicated", "fsdp") if turn % 2 == 0 else ("fsdp", "replicated")
                turn += 1
                for kind in kinds:
                    row = measure(kind, w, model_dir, args, batch)
                    rows.append({**row, "repeat": repeat})
                    print(json.dumps(rows[-1]), flush=True)
    ray.shutdown()
    report(rows, name, params)
    print(json.dumps({"model": name, "params": params, "rows": rows}))
    if args.json:
        Path(args.json).write_text(
            json.dumps({"model": name, "params": params, "rows": rows}, indent=1)
        )


if __name__ == "__main__":
    main()
