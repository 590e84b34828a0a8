"""Trainer: peak memory and seconds of one GRPO step, chunked fp32 log-probs at the loss's
positions (``--logprob-chunk 512``, the default) vs the whole vocabulary at every position
(``--logprob-chunk 0``), each measured in a fresh process.

One batch of ``--rows`` rows, each ``--prompt`` prompt tokens and a response of a length drawn
uniformly from ``--response MIN:MAX`` (random token ids of the model's vocabulary, seeded:
every process trains the same batch from the same weights with the same seed), right-padded
into one (rows, positions) batch, goes through the trainer's own single-process updater
(``trainer.step.LocalUpdater``, what ``--ray-workers 0`` builds): ``--steps`` updates
(forward, GRPO loss, backward, clip, AdamW), with default settings otherwise (no KL reference,
no entropy bonus, fp32, no micro-batches).

Each configuration runs in its own subprocess, so its peak resident memory is its own: the
child reads ``ru_maxrss`` after loading the model and building the batch ("after load") and
after the steps ("after step": everything torch and transformers hold, the activations, the
gradients and AdamW's state included). The weights are memory-mapped from the model's
safetensors file and count in the RSS once the forward pass reads them, so "after load" is
mostly the libraries. The configurations alternate (``--chunks`` in order, then
reversed, ...) for ``--repeat`` rounds; the table gives the median and range (min-max) over
rounds. "step s" is the first (or only) step's wall time; with ``--steps`` > 1 the later
ones are printed in the JSON lines too. The losses of the first step must agree across
configurations (the same update): their largest difference is printed as a check.

    PYTHONPATH=. python bench/trainer_memory.py [--model smol|tiny|DIR] [--chunks 512,0]
        [--repeat 5] [--rows 16] [--prompt 60] [--response 64:256] [--steps 1] [--threads 1]
        [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

MB = 1024 * 1024


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def bench_batch(
    rows: int,
    prompt: int,
    response: tuple[int, int],
    vocab: int,
    seed: int = 0,
    long_row: int = 0,
    group_prompt: bool = False,
):
    """The batch; ``long_row`` > 0 makes the first row that many tokens long (prompt
    included), as one long agentic trajectory among short ones; ``group_prompt``: the rows of
    each group of 8 share one prompt, as a GRPO group's samples do (else every row draws its
    own)."""
    from agentarium.schemas import LLMCall, Trajectory
    from agentarium.trainer.batch import Sample, build_rows, collate

    rng = random.Random(seed)
    samples = []
    prompts: dict[int, list[int]] = {}
    for i in range(rows):
        length = rng.randint(*response)
        if i == 0 and long_row:
            length = long_row - prompt
        call = LLMCall(
            prompt_ids=prompts.setdefault(
                i // 8 if group_prompt else i, [rng.randrange(vocab) for _ in range(prompt)]
            ),
            response_ids=[rng.randrange(vocab) for _ in range(length)],
            response_logprobs=[round(rng.uniform(-8.0, -0.1), 3) for _ in range(length)],
            finish_reason="stop",
        )
        traj = Trajectory(
            job_id=f"j{i}", agent="a", task_id="t", group_id=f"g{i // 8}", status="ok",
            reward=float(i % 2), calls=[call],
        )  # fmt: skip
        samples.append(Sample(traj, advantage=(i % 4 - 1.5) / 1.1))
    return collate(build_rows(samples)[0], pad_id=0)


def child(args: argparse.Namespace) -> None:
    """One configuration, in this (fresh) process: one JSON line on stdout."""
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
        run="bench",
        agent="a",
        model_dir=str(model_dir),
        lr=1e-5,
        logprob_chunk=args.child,
        pack_rows=False,  # the padded batch measured here (packed: bench/trainer_packing.py)
    )
    started = time.monotonic()
    updater = LocalUpdater(config)
    load_s = time.monotonic() - started
    before = peak_rss_mb()
    times, stats = [], []
    for step in range(args.steps):
        t0 = time.monotonic()
        result = updater.step(batch, seed=step)
        times.append(time.monotonic() - t0)
        stats.append(result)
    after = peak_rss_mb()
    first = stats[0]
    print(
        json.dumps(
            {
                "chunk": args.child,
                "rss_load_mb": round(before),
                "rss_after_mb": round(after),
                "step_s": [round(t, 2) for t in times],
                "load_s": round(load_s, 1),
                "loss": first.loss,
                "grad_norm": first.grad_norm,
                "entropy": first.entropy,
                "ratio_mean": first.ratio_mean,
                "rows": batch.rows,
                "positions": int(batch.input_ids.shape[1]),
                "tokens": batch.tokens,
                "model_tokens": batch.model_tokens,
                "vocab": vocab,
            }
        ),
        flush=True,
    )


def run_child(chunk: int, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", str(chunk)]
    for name in ("model", "rows", "prompt", "response", "steps", "threads"):
        command += [f"--{name}", str(getattr(args, name))]
    load = os.getloadavg()[0]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.exit(f"chunk {chunk}: exit {done.returncode}\n{done.stderr[-4000:]}")
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {**row, "load": round(load, 2)}


def cell(values: list[float], digits: int) -> str:
    """Median (min-max)."""
    med, lo, hi = statistics.median(values), min(values), max(values)
    return f"{med:.{digits}f} ({lo:.{digits}f}-{hi:.{digits}f})"


def report(rows: list[dict], chunks: list[int]) -> None:
    first = rows[0]
    repeats = max(r["repeat"] for r in rows) + 1
    loads = [r["load"] for r in rows]
    print(
        f"\n{first['rows']} rows x {first['positions']} positions, {first['tokens']} tokens "
        f"({first['model_tokens']} in the loss), vocabulary {first['vocab']:,}; {repeats} "
        f"round(s), median (min-max); load average {min(loads):.1f}-{max(loads):.1f}"
    )
    print("| --logprob-chunk | peak RSS MB after load | peak RSS MB after step | step s |")
    print("|---|---|---|---|")
    for chunk in chunks:
        same = [r for r in rows if r["chunk"] == chunk]
        print(
            f"| {chunk} | {cell([r['rss_load_mb'] for r in same], 0)} | "
            f"{cell([r['rss_after_mb'] for r in same], 0)} | "
            f"{cell([r['step_s'][0] for r in same], 2)} |"
        )
    whole = {r["repeat"]: r for r in rows if r["chunk"] == 0}
    for chunk in (c for c in chunks if c != 0 and whole):
        pairs = [(r, whole[r["repeat"]]) for r in rows if r["chunk"] == chunk]
        saved = [w["rss_after_mb"] - r["rss_after_mb"] for r, w in pairs]
        share = [
            100 * (w["rss_after_mb"] - r["rss_after_mb"]) / w["rss_after_mb"] for r, w in pairs
        ]
        speed = [w["step_s"][0] / r["step_s"][0] for r, w in pairs]
        print(
            f"--logprob-chunk {chunk} vs 0, per round: peak RSS {cell(saved, 0)} MB lower "
            f"({cell(share, 1)} %), step {cell(speed, 2)}x as fast"
        )
    for key in ("loss", "grad_norm", "entropy", "ratio_mean"):
        values = [r[key] for r in rows]
        print(f"first step's {key}: max abs difference {max(values) - min(values):.3g}", end="")
        print(f" over all {len(values)} runs (value {values[0]:.6g})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smol", help="smol, tiny or a model directory")
    parser.add_argument("--chunks", default="512,0", help="--logprob-chunk values to compare")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--response", default="64:256", metavar="MIN:MAX")
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args)
        return
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    for repeat in range(args.repeat):
        for chunk in chunks if repeat % 2 == 0 else chunks[::-1]:
            row = {**run_child(chunk, args), "repeat": repeat}
            rows.append(row)
            print(json.dumps(row), flush=True)
    report(rows, chunks)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
