"""GPU benchmark: replicated data parallel vs FSDP2, per rank, on a random Qwen2.5-0.5B-shaped
model: peak CUDA memory, parameter + optimizer bytes and step time of the trainer's own step.

Each rank (``torchrun --nproc-per-node N``, one GPU each; without torchrun, one rank) builds
the model of ``bench/gpu_grpo_step.py`` in code (fp32 master weights, nothing downloaded), the
same synthetic GRPO batch, and its contiguous shard of it. ``--mode replicated`` keeps the
whole model and AdamW on every rank and all-reduces the summed gradients (what
``trainer/ray_dp.py`` does); ``--mode fsdp`` shards it with ``trainer.fsdp.shard_model``
(``fully_shard`` per decoder layer and on the model, summed reduce-scatter; with ``--bf16`` the
bf16 ``MixedPrecisionPolicy``) and pads short ranks with idle passes, as ``--parallel fsdp``
does. Both run ``trainer.step.forward_backward`` and ``apply_update`` with the loss normalised
by the whole batch. ``--activation-checkpointing`` recomputes each decoder layer.

Prints one JSON line per rank and writes $OUT/gpu_fsdp_<mode>_rank<r>.json when OUT is set.

    torchrun --nproc-per-node 1 bench/gpu_fsdp.py --mode fsdp --bf16        # from the repo root
    torchrun --nproc-per-node 1 bench/gpu_fsdp.py --mode replicated --bf16
    PYTHONPATH=. python bench/gpu_fsdp.py --device cpu --tiny --steps 1 --warmup 0  # CPU smoke
    PYTHONPATH=. torchrun --nproc-per-node 2 bench/gpu_fsdp.py --device cpu --tiny --steps 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=("replicated", "fsdp"), default="fsdp")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (smoke test)")
    p.add_argument("--bf16", action="store_true", help="bf16 compute, fp32 master weights")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--response-len", type=int, default=256)
    p.add_argument("--length-jitter", type=float, default=0.25)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from bench.gpu_grpo_step import FULL_SHAPE, TINY_SHAPE, build_model, ensure_msgpack

    ensure_msgpack()
    import torch
    import torch.distributed as dist

    from agentarium.trainer.batch import build_rows, collate
    from agentarium.trainer.fsdp import idle_pass, passes_of, shard_model
    from agentarium.trainer.step import (
        StepSettings,
        Totals,
        apply_update,
        forward_backward,
        make_optimizer,
        memory_of,
    )

    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    local = int(os.environ.get("LOCAL_RANK", 0))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(local)
    device = torch.device(f"cuda:{local}" if cuda else "cpu")
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world)
    shape = TINY_SHAPE if args.tiny else FULL_SHAPE
    model = build_model(shape, torch.float32, device, args.seed)
    if args.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    fsdp = args.mode == "fsdp"
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh

        shard_model(model, init_device_mesh(device.type, (world,)), mixed_precision=args.bf16)
    settings = StepSettings(
        micro_batch_size=args.micro_batch_size, bf16_autocast=args.bf16 and not fsdp
    )
    optimizer = make_optimizer(model, settings)
    from bench.gpu_grpo_step import synthetic_samples

    samples = synthetic_samples(args, shape["vocab_size"], shape["eos_token_id"])
    batch = collate(build_rows(samples)[0], pad_id=0)
    totals = Totals.of(batch)
    shards = batch.shards(world)
    passes = max(1, *(len(passes_of(s, settings)) for s in shards))
    shard = shards[rank]

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        micro = passes_of(shard, settings)
        micro += [idle_pass()] * (passes - len(micro))
        forward_backward(model, None, shard, settings, totals, device, micro_batches=micro)
        if not fsdp and world > 1:  # the replicated trainer's one all-reduce
            params = [p for p in model.parameters() if p.requires_grad]
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for p in params:
                p.grad = flat[offset : offset + p.numel()].view_as(p).clone()
                offset += p.numel()
        return apply_update(model, optimizer, settings.grad_clip)

    times = []
    for i in range(args.warmup + args.steps):
        if cuda:
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize(device)
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    held = memory_of(model, optimizer)
    out = {
        "mode": args.mode,
        "rank": rank,
        "world": world,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "params": sum(p.numel() for p in model.parameters()),  # a DTensor counts its whole
        "bf16": args.bf16,
        "activation_checkpointing": args.activation_checkpointing,
        "rows": batch.rows,
        "tokens": batch.tokens,
        "step_s": round(statistics.median(times), 4) if times else None,
        "tokens_per_s": round(batch.tokens / statistics.median(times), 1) if times else None,
        "params_gib": round(held["params"] / 2**30, 3),
        "optimizer_gib": round(held["optimizer"] / 2**30, 3),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
        if cuda
        else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / 2**30, 3)
        if cuda
        else None,
    }
    print(json.dumps(out), flush=True)
    if os.environ.get("OUT"):
        name = f"gpu_fsdp_{args.mode}_rank{rank}.json"
        (Path(os.environ["OUT"]) / name).write_text(json.dumps(out, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
