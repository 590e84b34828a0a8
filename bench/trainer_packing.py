"""Trainer: one GRPO step padded vs packed (``--pack-rows``), with and without activation
checkpointing, beside TRL's GRPOTrainer on the same batch, against the machine's own fp32
matrix-multiply rate.

The batch is bench/trainer_memory.py's (``--rows`` rows of ``--prompt`` prompt tokens and a
response drawn from ``--response MIN:MAX``, seeded, right-padded), trained by the trainer's
single-process updater (``trainer.step.LocalUpdater``) with default settings but the ones
compared, and by TRL's ``GRPOTrainer.compute_loss`` (``trl``: its "dapo" loss, fp32, its fused
log-prob head, then backward, clip and AdamW as ours). Every configuration computes the same
loss (``SAME_LOSS``): the first step's losses and gradient norms printed at the end must agree.
Each configuration runs in a fresh subprocess (its peak RSS its own), the
configurations alternate (in order, then reversed, ...) for ``--repeat`` rounds, and the
table gives median (min-max) over rounds of:

- step s: the first step's wall time (forward, loss, backward, clip, AdamW);
- GFLOP/s: 6 x trainable parameters x real tokens / step s, the usual count of a step's
  matrix work (attention's own, small at these lengths, is left out), so padding is work that
  earns nothing;
- the step's user and kernel CPU seconds and minor page faults (a line per configuration
  under the table: a step whose allocator returns its tensors' pages to the system faults
  them in again, in the kernel);
- peak RSS after the step (model, gradients, AdamW's state, activations, libraries), in MiB;
  with ``--steps N``, after N steps on the batch (our configurations; TRL's runs one), so
  AdamW's moments, made at the first update, are held through the later ones
  (``ru_maxrss``).

Before the rounds, the machine's fp32 matmul rate is measured with torch (square 2048
matrices, median of 5) on one thread and on all, and each configuration's rate is printed as a
share of the one-thread rate (the children train on ``--threads``, 1 by default). The rate is
also measured right before and right after each child, on its threads, in a process of its
own: a shared machine's rate moves (89-98 GFLOP/s in two runs an hour apart,
docs/benchmarks.md), so the table gives each run's share of the mean of the two readings
beside it as well. The first
step's losses must agree across configurations (the same update): their largest difference
is printed.

    PYTHONPATH=. python bench/trainer_packing.py [--model smol|tiny|DIR] [--configs padded,packed,packed-ckpt,trl]
        [--repeat 5] [--rows 16] [--prompt 60] [--response 64:256] [--threads 1] [--json OUT]
        [--steps 3]   # the peak over three steps: the later ones hold AdamW's moments too
        [--timeline]   # where in each step the peak RSS fell (bench/memory_timeline.py)
        # the least memory: --configs packed,small,small-mapped,trl (``CONFIGS``, ``CHILD_ENV``)
        [--long-row 8192 --max-tokens 2048]   # one 8,192-token row among short ones
        [--group-prompt]   # each group of 8 rows shares its prompt, as GRPO's do
        # (then "packed" runs a pass's common prompt once; "packed-unshared" does not)
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
from memory_timeline import Timeline, table  # noqa: E402
from trainer_memory import bench_batch, cell, peak_rss_mb  # noqa: E402

from agentarium.trainer.heap import TRAINER_MALLOC_ENV, running_allocator  # noqa: E402

# Our trainer's settings per configuration; "trl" is TRL's GRPOTrainer (trl_child). Every
# configuration uses the loss TRL's "dapo" computes: the clipped surrogate at ratio clip 0.2
# either side, summed over the batch's loss tokens and divided by their count, no dual clip,
# no KL, no entropy term; AdamW (lr 1e-5, betas 0.9/0.999, no weight decay), grad clip 1.0.
SAME_LOSS = {"clip_low": 0.2, "clip_high": 0.2, "dual_clip": None, "loss_agg": "token-mean"}
CONFIGS = {
    "padded": {"pack_rows": False, "memory": "fast"},
    "packed": {"pack_rows": True, "memory": "fast"},
    # packed, a prompt every row of a pass begins with packed with each row (a shared prefix
    # runs once a pass by default: trainer/packing.py); the same as "packed" without
    # --group-prompt, whose rows share nothing
    "packed-unshared": {"pack_rows": True, "share_prefix": False, "memory": "fast"},
    "packed-ckpt": {"pack_rows": True, "activation_checkpointing": True, "memory": "fast"},
    # --memory small (trainer/memory.py): checkpointed, AdamW's moments in 3 bytes a parameter
    # (trainer/optim.py), passes of at most 256 real tokens, log-probs 32 positions at a
    # time, a longer pass's feed-forward blocks 512 positions at a time, on glibc's malloc
    "small": {"memory": "small"},
    # the trainer's defaults, on the allocator `agentarium trainer` picks for them
    # (trainer/process.py, allocator_for: jemalloc for SmolLM2's full fine-tuning)
    "defaults": {},
    "trl": {},
}
CONFIGS["small-mapped"] = CONFIGS["small"]  # in a process started with TRAINER_MALLOC_ENV
# a configuration's process environment on top of the bench's: glibc's mmap threshold fixed at
# 1 MiB with huge pages (trainer/heap.py), so a pass's freed tensors leave the process at once
CHILD_ENV = {"small-mapped": TRAINER_MALLOC_ENV}
# the defaults on jemalloc with and without transparent huge pages, whatever heap.JEMALLOC_CONF
# says (its "thp:always" held up to about 180 MiB of RSS that jemalloc's counters do not see)
for _name, _thp in (("defaults-thp", "thp:always,"), ("defaults-no-thp", "")):
    CONFIGS[_name] = {}
    CHILD_ENV[_name] = {
        "MALLOC_CONF": f"{_thp}oversize_threshold:0,dirty_decay_ms:-1,muzzy_decay_ms:-1"
    }


def trl_child(args: argparse.Namespace, model_dir: Path, batch) -> dict:
    """TRL's GRPOTrainer (fp32, its fused log-prob head, no checkpointing: TRL's CPU settings
    in examples/trl_trainer.py) on the same rows: its ``compute_loss`` on the batch split as
    TRL holds it (prompt ids left-padded, completion ids right-padded), backward, clip, AdamW."""
    import tempfile

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    rows, prompt = batch.rows, args.prompt  # every row's prompt is --prompt tokens
    lengths = batch.attention_mask.sum(-1)
    completion = int(lengths.max()) - prompt
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench-trl-"),
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        per_device_train_batch_size=rows,
        num_generations=min(8, rows),
        max_completion_length=completion,
        beta=0.0,
        loss_type="dapo",
        epsilon=0.2,
        epsilon_high=0.2,
        learning_rate=1e-5,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[lambda completions, **_: [0.0] * len(completions)],
        args=config,
        train_dataset=Dataset.from_list([{"prompt": "x"}] * rows),
    )
    trainer.current_gradient_accumulation_steps = 1  # set by the training loop, run here by hand
    model = trainer.model
    model.train()
    completion_mask = batch.loss_mask[:, prompt : prompt + completion].to(torch.long)
    inputs = {
        "prompt_ids": batch.input_ids[:, :prompt],
        "prompt_mask": batch.attention_mask[:, :prompt],
        "completion_ids": batch.input_ids[:, prompt : prompt + completion],
        "completion_mask": completion_mask,
        "advantages": batch.advantages[:, prompt],
        "old_per_token_logps": batch.old_logprobs[:, prompt : prompt + completion],
        "num_items_in_batch": completion_mask.sum().to(torch.float32),
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.999), weight_decay=0)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    t0, before = time.monotonic(), usage()
    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    step_s = time.monotonic() - t0
    return {"step_s": step_s, "loss": float(loss), "grad_norm": grad_norm, "params": params,
            **usage_since(before)}  # fmt: skip


def usage() -> tuple[float, float, int]:
    """This process's user and kernel CPU seconds and minor page faults so far."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_SELF)
    return ru.ru_utime, ru.ru_stime, ru.ru_minflt


def usage_since(before: tuple[float, float, int]) -> dict:
    """User and kernel seconds and minor page faults since ``before`` (``usage()``): a step
    that maps and frees its tensors spends kernel time faulting their pages in again."""
    now = usage()
    return {
        "user_s": round(now[0] - before[0], 2),
        "sys_s": round(now[1] - before[1], 2),
        "minflt": now[2] - before[2],
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
    from agentarium.trainer import TrainerProcess, allocator_for, use_allocator
    from agentarium.trainer.config import TrainerConfig
    from agentarium.trainer.step import LocalUpdater

    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    vocab = int(json.loads((model_dir / "config.json").read_text())["vocab_size"])
    low, high = (int(x) for x in args.response.split(":"))
    batch = bench_batch(
        args.rows, args.prompt, (low, high), vocab, long_row=args.long_row,
        group_prompt=args.group_prompt,
    )  # fmt: skip
    if args.child == "trl":
        step = trl_child(args, model_dir, batch)
    else:
        config = TrainerConfig(
            run="bench",
            agent="a",
            model_dir=str(model_dir),
            lr=1e-5,
            **{"max_tokens_per_micro_batch": args.max_tokens, **SAME_LOSS, **CONFIGS[args.child]},
        )
        if args.child.startswith("defaults"):  # as `agentarium trainer` starts: this again, on it
            use_allocator(allocator_for(config, TrainerProcess()))
        updater = LocalUpdater(config)
        params = sum(p.numel() for p in updater.model.parameters() if p.requires_grad)
        timeline = Timeline(updater.model, updater.optimizer) if args.timeline else None
        if timeline:
            timeline.step()
        t0, before = time.monotonic(), usage()
        stats = updater.step(batch, seed=0)
        step = {
            "step_s": time.monotonic() - t0,
            "loss": stats.loss,
            "grad_norm": stats.grad_norm,
            "params": params,
            **usage_since(before),
        }
        # --steps: the same batch again; from the second step AdamW's moments are held too
        later = []
        for seed in range(1, args.steps):
            if timeline:
                timeline.step()
            t1 = time.monotonic()
            updater.step(batch, seed=seed)
            later.append(round(time.monotonic() - t1, 2))
        step["later_s"] = later
        if timeline:
            step["timeline"] = timeline.close()
    step_s, params = step["step_s"], step["params"]
    print(
        json.dumps(
            {
                "config": args.child,
                "step_s": round(step_s, 2),
                "gflops": round(6 * params * batch.tokens / step_s / 1e9, 2),
                "rss_mb": round(peak_rss_mb()),
                "steps": 1 + len(step.get("later_s", [])),
                "later_s": step.get("later_s", []),
                **{k: step[k] for k in ("user_s", "sys_s", "minflt")},
                "allocator": running_allocator(),
                "loss": step["loss"],
                "grad_norm": step["grad_norm"],
                "params": params,
                "rows": batch.rows,
                "positions": int(batch.input_ids.shape[1]),
                "tokens": batch.tokens,
                **({"timeline": step["timeline"]} if "timeline" in step else {}),
            }
        ),
        flush=True,
    )


def run_child(name: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, __file__, "--child", name]
    for flag in (
        "model",
        "rows",
        "prompt",
        "response",
        "threads",
        "long_row",
        "max_tokens",
        "steps",
    ):
        command += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    command += ["--group-prompt"] if args.group_prompt else []
    command += ["--timeline"] if args.timeline else []
    load = os.getloadavg()[0]
    env = {**os.environ, **CHILD_ENV.get(name, {})}
    before = rate_beside(args.threads)
    done = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if done.returncode != 0:
        sys.exit(f"{name}: exit {done.returncode}\n{done.stderr[-4000:]}")
    rate = (before + rate_beside(args.threads)) / 2
    row = json.loads(done.stdout.strip().splitlines()[-1])
    return {**row, "matmul_gflops": round(rate, 1), "load": round(load, 2)}


def rate_beside(threads: int) -> float:
    """The matmul rate on ``threads`` threads, measured in a process of its own: in a child,
    its three freed 16 MiB matrices would raise glibc's mmap threshold for the step after them
    (TRL's runs on glibc), and the child would no longer be the step alone."""
    command = [sys.executable, __file__, "--rate-only", str(threads)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return float(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smol", help="smol, tiny or a model directory")
    parser.add_argument(
        "--configs", default="padded,packed,packed-ckpt,trl", help=", ".join(CONFIGS)
    )
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--prompt", type=int, default=60)
    parser.add_argument("--response", default="64:256", metavar="MIN:MAX")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--long-row",
        type=int,
        default=0,
        metavar="TOKENS",
        help="make the first row this long (one long trajectory among short ones)",
    )
    parser.add_argument(
        "--max-tokens",
        type=int,
        default=0,
        metavar="TOKENS",
        help="our configurations' --max-tokens-per-micro-batch (0: the batch in one pass)",
    )
    parser.add_argument(
        "--group-prompt",
        action="store_true",
        help="the rows of each group of 8 share one prompt, as a GRPO group's samples do "
        "(default: every row its own)",
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=1,
        help="our configurations train this many steps on the batch (TRL's one): the step "
        "time is the first's, the peak RSS over all of them (AdamW's moments exist from the "
        "second step on)",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="our configurations also sample their RSS every millisecond, and each run "
        "prints where in its steps the highest readings fell (bench/memory_timeline.py)",
    )
    parser.add_argument("--json", default="", help="also write the rows here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rate-only", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rate_only < 0:
        parser.error(f"--rate-only takes a thread count, got {args.rate_only}")
    if args.rate_only:
        print(matmul_gflops(args.rate_only))
        return
    if args.child is not None:
        child(args)
        return
    for name in ("repeat", "rows", "prompt", "threads", "steps"):
        if getattr(args, name) < 1:
            parser.error(
                f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
            )
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
            print(json.dumps({k: v for k, v in row.items() if k != "timeline"}), flush=True)
            if row.get("timeline"):
                print(f"{name}, round {repeat + 1}: the highest readings ({row['rss_mb']} "
                      f"MiB ru_maxrss)\n{table(row['timeline'])}", flush=True)  # fmt: skip
    first = rows[0]
    loads = [r["load"] for r in rows]
    print(
        f"\n{first['rows']} rows x {first['positions']} positions, {first['tokens']} real "
        f"tokens, {first['params']:,} parameters, {args.threads} thread(s); {args.repeat} "
        f"round(s), median (min-max); load average {min(loads):.1f}-{max(loads):.1f}"
    )
    over = f", over {args.steps} steps (TRL: 1)" if args.steps > 1 else ""
    print(
        f"| config | step s | GFLOP/s on real tokens | share of {one:.1f} | matmul beside the "
        f"run | share of it | peak RSS MiB{over} |"
    )
    print("|---|---|---|---|---|---|---|")
    for name in names:
        same = [r for r in rows if r["config"] == name]
        share = [100 * r["gflops"] / one for r in same]
        beside = [100 * r["gflops"] / r["matmul_gflops"] for r in same]
        print(
            f"| {name} | {cell([r['step_s'] for r in same], 2)} | "
            f"{cell([r['gflops'] for r in same], 1)} | {cell(share, 0)} % | "
            f"{cell([r['matmul_gflops'] for r in same], 1)} | {cell(beside, 0)} % | "
            f"{cell([r['rss_mb'] for r in same], 0)} |"
        )
    for name in names:
        same = [r for r in rows if r["config"] == name]
        print(f"{name}, the first step: user {cell([r['user_s'] for r in same], 1)} s, kernel "
              f"{cell([r['sys_s'] for r in same], 1)} s, minor page faults "
              f"{cell([r['minflt'] / 1e6 for r in same], 2)} M")  # fmt: skip
    for key in ("loss", "grad_norm"):
        values = [r[key] for r in rows]
        print(f"first step's {key}: max abs difference {max(values) - min(values):.3g} "
              f"over {len(values)} runs (value {values[0]:.6g})")  # fmt: skip
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
