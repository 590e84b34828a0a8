"""Trainer memory: how much of a step's RSS is glibc's heap rather than live tensors, and what
``--heap release`` (trainer/heap.py) gives back.

Runs ``--steps`` steps of the trainer's single-process updater (``trainer.step.LocalUpdater``)
on bench/trainer_memory.py's seeded batch, in a worker thread as the trainer runs its steps,
once per configuration, each in a fresh process, the configurations alternated over
``--rounds`` rounds (the order reversed every other round). It prints the RSS after each step,
the peak RSS and the step times, one JSON line per run, then each configuration's median and
range. A configuration is a trainer setting set and a heap mode after ``+``:

- ``release``: ``--heap release``, the trainer's default (``malloc_trim`` after each pass and
  each step);
- ``glibc``: ``--heap default``, glibc as it is;
- ``release-env``: ``release`` in a process started with trainer/heap.py's
  ``TRAINER_MALLOC_ENV`` (the mmap threshold fixed at 1 MiB, transparent huge pages asked
  for), as the demo starts its trainer.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/trainer_allocator.py --rounds 5 --steps 2 \\
        lora-4096+glibc lora-4096+release lora-4096+release-env
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agentarium.trainer import TRAINER_MALLOC_ENV  # noqa: E402 - light: no torch

CONFIGS = {
    "full-4096": {"max_tokens_per_micro_batch": 4096},
    "lora-4096": {"lora_rank": 16, "max_tokens_per_micro_batch": 4096},
    "lora-2048": {"lora_rank": 16, "max_tokens_per_micro_batch": 2048},
    "lora-4096-ckpt": {
        "lora_rank": 16,
        "max_tokens_per_micro_batch": 4096,
        "activation_checkpointing": True,
    },
}
HEAPS = {  # mode -> (--heap, the process's environment)
    "release": ("release", {}),
    "glibc": ("default", {}),
    "release-env": ("release", TRAINER_MALLOC_ENV),
}


def rss_mb() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS"):
            return int(line.split()[1]) // 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(args: argparse.Namespace) -> None:
    import torch
    from trainer_memory import bench_batch, peak_rss_mb

    from agentarium.models import resolve_model
    from agentarium.trainer.config import TrainerConfig
    from agentarium.trainer.step import LocalUpdater

    torch.set_num_threads(1)
    model_dir = resolve_model(args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    low, high = (int(x) for x in args.response.split(":"))
    batch = bench_batch(args.rows, args.prompt, (low, high), vocab)
    name, _, mode = args.child.partition("+")
    settings = {**CONFIGS[name], "heap": HEAPS[mode][0]}
    config = TrainerConfig(run="bench", agent="a", model_dir=str(model_dir), lr=1e-5, **settings)
    pool = concurrent.futures.ThreadPoolExecutor(4)  # off the main thread, as asyncio.to_thread
    updater = pool.submit(LocalUpdater, config).result()
    out: dict = {"config": args.child, "tokens": batch.tokens, "rss_after_load": rss_mb()}
    for k in range(args.steps):
        t0 = time.monotonic()
        pool.submit(updater.step, batch, seed=k).result()
        out[f"step{k + 1}_s"] = round(time.monotonic() - t0, 1)
        out[f"rss_after_step{k + 1}"] = rss_mb()
    out["peak_rss"] = round(peak_rss_mb())
    print(json.dumps(out), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "configs",
        nargs="*",
        default=["lora-4096+glibc", "lora-4096+release", "lora-4096+release-env"],
    )
    parser.add_argument("--model", default="smol", help="smol, tiny or a model directory")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=250)
    parser.add_argument("--response", default="150:350", metavar="MIN:MAX")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    for name in args.configs:
        base, _, mode = name.partition("+")
        if base not in CONFIGS or mode not in HEAPS:
            sys.exit(f"unknown configuration {name!r}: {sorted(CONFIGS)}, each +{'|'.join(HEAPS)}")
    runs: dict[str, list[dict]] = {name: [] for name in args.configs}
    for r in range(args.rounds):
        for name in args.configs if r % 2 == 0 else list(reversed(args.configs)):
            mode = name.partition("+")[2]
            command = [sys.executable, __file__, "--child", name, "--model", args.model]
            for flag in ("rows", "prompt", "response", "steps"):
                command += [f"--{flag}", str(getattr(args, flag))]
            env = {**os.environ, **HEAPS[mode][1]}
            done = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
            if done.returncode != 0:
                sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
            line = done.stdout.strip().splitlines()[-1]
            runs[name].append(json.loads(line))
            print(line, flush=True)
    print(f"medians (range) over {args.rounds} rounds:")
    for name, results in runs.items():
        row = []
        for key in ("step_s", "rss_after_last_step", "peak_rss"):
            if key == "step_s":
                values = [v for res in results for k, v in res.items() if k.endswith("_s")]
            elif key == "rss_after_last_step":
                values = [res[f"rss_after_step{args.steps}"] for res in results]
            else:
                values = [res[key] for res in results]
            row.append(f"{key} {statistics.median(values):g} ({min(values):g}-{max(values):g})")
        print(f"  {name}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
