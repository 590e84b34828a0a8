"""Trainer: one GRPO step padded vs packed (``--pack-rows``), with and without activation
checkpointing, against the machine's own fp32 matrix-multiply rate.

The batch is bench/trainer_memory.py's (``--rows`` rows of ``--prompt`` prompt tokens and a
response drawn from ``--response MIN:MAX``, seeded, right-padded), trained by the trainer's
single-process updater (``trainer.step.LocalUpdater``) with default settings but the ones
compared. Each configuration runs in a fresh subprocess (its peak RSS its own), the
configurations alternate (in order, then reversed, ...) for ``--repeat`` rounds, and the
table gives median (min-max) over rounds of:

- step s: the first step's wall time (forward, loss, backward, clip, AdamW);
- GFLOP/s: 6 x trainable parameters x real tokens / step s, the usual count of a step's
  matrix work (attention's own, small at these lengths, is left out), so padding is work that
  earns nothing;
- peak RSS after the step (model, gradients, AdamW's state, activations, libraries).

Before the rounds, the machine's fp32 matmul rate is measured with torch (square 2048
matrices, median of 5) on one thread and on all, and each configuration's rate is printed as a
share of the one-thread rate (the children train on ``--threads``, 1 by default). The first
step's losses must agree across configurations (the same update): their largest difference
is printed.

    PYTHONPATH=. python bench/trainer_packing.py [--model smol|tiny|DIR] [--configs padded,packed,packed-ckpt]
        [--repeat 5] [--rows 16] [--prompt 60] [--response 64:256] [--threads 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from trainer_memory import bench_batch, cell, peak_rss_mb  # noqa: E402

CONFIGS = {
    "padded": {"pack_rows": False},
    "packed": {"pack_rows": True},
    "packed-ckpt": {"pack_rows": True, "activation_checkpointing": True},
}


def matmul_gflops(threads: int, n: int = 2048, repeat: int = 5) -> float:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, b = torch.randn(n, n), torch.randn(n, n)
        a @ b  # warm up
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            a @ b
            times.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return 2 * n**3 / statistics.median(times) / 1e9


def child(args: argparse.Namespace) -> None:
    import torch

    from agentarium.models import resolve_model
    from agentarium.trainer.config import TrainerConfig
    from agentarium.trainer.step import LocalUpdater

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    low, high = (int(x) for x in args.response.split(":"))
    batch = bench_batch(args.rows, args.prompt, (low, high), vocab)
    config = TrainerConfig(
        run="bench", agent="a", model_dir=str(model_dir), lr=1e-5, **CONFIGS[args.child]
    )
    updater = LocalUpdater(config)
    params = sum(p.numel() for p in updater.model.parameters() if p.requires_grad)
    t0 = time.monotonic()
    stats = updater.step(batch, seed=0)
    step_s = time.monotonic() - t0
    print(
        json.dumps(
            {
                "config": args.child,
                "step_s": round(step_s, 2),
                "gflops": round(6 * params * batch.tokens / step_s / 1e9, 2),
                "rss_mb": round(peak_rss_mb()),
                "loss": stats.loss,
                "grad_norm": stats.grad_norm,
                "params": params,
                "rows": batch.rows,
                "positions": int(batch.input_ids.shape[1]),
                "tokens": batch.tokens,
            }
        ),
        flush=True,
    )


def run_child(name: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", name]
    for flag in ("model", "rows", "prompt", "response", "threads"):
        command += [f"--{flag}", str(getattr(args, flag))]
    load = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
    return {**json.loads(done.stdout.strip().splitlines()[-1]), "load": round(load, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smol", help="smol, tiny or a model directory")
    parser.add_argument("--configs", default="padded,packed,packed-ckpt", help=", ".join(CONFIGS))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--response", default="64:256", metavar="MIN:MAX")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return
    names = [c for c in args.configs.split(",") if c]
    unknown = [c for c in names if c not in CONFIGS]
    if unknown:
        parser.error(f"--configs: unknown {unknown}; known: {', '.join(CONFIGS)}")
    one, every = matmul_gflops(1), matmul_gflops(os.cpu_count() or 1)
    print(f"fp32 matmul (2048^3): {one:.1f} GFLOP/s on 1 thread, {every:.1f} on {os.cpu_count()}")
    rows = []
    for repeat in range(args.repeat):
        for name in names if repeat % 2 == 0 else names[::-1]:
            row = {**run_child(name, args), "repeat": repeat}
            rows.append(row)
            print(json.dumps(row), flush=True)
    first = rows[0]
    loads = [r["load"] for r in rows]
    print(
        f"\n{first['rows']} rows x {first['positions']} positions, {first['tokens']} real "
        f"tokens, {first['params']:,} parameters, {args.threads} thread(s); {args.repeat} "
        f"round(s), median (min-max); load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print("| config | step s | GFLOP/s on real tokens | share of 1-thread matmul | peak RSS MB |")
    print("|---|---|---|---|---|")
    for name in names:
        same = [r for r in rows if r["config"] == name]
        share = [100 * r["gflops"] / one for r in same]
        print(
            f"| {name} | {cell([r['step_s'] for r in same], 2)} | "
            f"{cell([r['gflops'] for r in same], 1)} | {cell(share, 0)} % | "
            f"{cell([r['rss_mb'] for r in same], 0)} |"
        )
    for key in ("loss", "grad_norm"):
        values = [r[key] for r in rows]
        print(f"first step's {key}: max abs difference {max(values) - min(values):.3g} "
              f"over {len(values)} runs (value {values[0]:.6g})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
