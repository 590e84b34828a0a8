"""GPU benchmark: one GRPO step of our trainer on a random-initialised Qwen2.5-0.5B-shaped model.

Builds a Qwen2 causal LM from a transformers ``Qwen2Config`` in code (Qwen2.5-0.5B's shape:
hidden 896, 24 layers, 14 heads, 2 KV heads, intermediate 4864, vocab 151936, untied lm_head;
random weights, bf16 by default: nothing is downloaded), makes --groups x --group-size synthetic
trajectories (``schemas.Trajectory`` / ``LLMCall`` with random token ids and log-probs near the
random model's own), and runs the trainer's step on them: ``trainer.batch.build_rows`` and
``collate`` (as trainer/loop.py does), then ``trainer.step.LocalUpdater.step`` (torch seed,
``forward_backward`` over micro-batches of --micro-batch-size rows, ``apply_update``: grad clip +
AdamW). The updater is assembled around the in-memory model because ``LocalUpdater.__init__``
loads a model directory in float32; its settings come from a real ``TrainerConfig``.

Reports the median step time over --steps timed steps after --warmup steps, tokens/s (every
real token, prompts included, and the generated tokens that carry the loss), an approximate
model TFLOP/s (6 x matmul params x tokens + 6 x layers x hidden x length^2 per row for causal
attention, forward + backward) and peak CUDA memory (max allocated and reserved). Prints a
table and one JSON line; writes the JSON to $OUT/gpu_grpo_step.json when OUT is set.
--micro-batch-size takes a comma list (e.g. 8,16) to compare sizes on one model build; a size
that runs out of memory is reported as such and the next one still runs.

The trainer's --pack-rows (on by default: no padding computed), --activation-checkpointing and
--max-tokens-per-micro-batch are flags here too, set up as the trainer sets up its policy.

Imports beyond torch and transformers: numpy and msgpack (the ``schemas`` package imports both;
numpy is a transformers dependency). If msgpack is missing, a stub stands in for it: the step
never encodes or decodes a message. Nothing else (no nats, structlog, ray, aiohttp).

    PYTHONPATH=. python3 bench/gpu_grpo_step.py [--device cuda] [--steps 5] [--warmup 2]
        [--micro-batch-size 8] [--prompt-len 256] [--response-len 256] [--groups 16]
        [--group-size 8] [--dtype bfloat16|float32] [--time-budget 240] [--tiny]
    python bench/gpu_grpo_step.py --device cpu --tiny --steps 2 --warmup 1   # CPU smoke test
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Qwen2.5-0.5B's shape (its released config ties the embeddings; this benchmark does not).
FULL_SHAPE = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "vocab_size": 151936,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "bos_token_id": 151643,
    "eos_token_id": 151643,
}
TINY_SHAPE = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "intermediate_size": 128,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "use_sliding_window": False,
    "bos_token_id": 511,
    "eos_token_id": 511,
}
GIB = 1024**3


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--steps", type=int, default=5, help="timed steps (median reported)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument(
        "--micro-batch-size",
        default="8",
        help="rows per forward/backward (0 = whole batch); a comma list runs each in turn",
    )
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument(
        "--length-jitter",
        type=float,
        default=0.25,
        help="lengths drawn uniformly in len*(1 +- jitter): prompt per group, response per "
        "sample (0 = every row exactly prompt-len + response-len, no padding)",
    )
    parser.add_argument("--groups", type=int, default=16)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="weights' dtype (the trainer keeps fp32 weights; use float32 with --bf16-autocast "
        "for its --bf16 mode)",
    )
    parser.add_argument(
        "--bf16-autocast",
        action="store_true",
        help="the trainer's --bf16: forward passes under bf16 autocast, fp32 weights and AdamW",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--time-budget",
        type=float,
        default=240.0,
        help="seconds from start after which no further timed step is begun",
    )
    parser.add_argument("--tiny", action="store_true", help="hidden 64, 2 layers, vocab 512")
    parser.add_argument(
        "--pack-rows",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the trainer's --pack-rows (default): each pass runs its rows' real tokens as one "
        "sequence, attention within each row; --no-pack-rows pads them to the longest",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action="store_true",
        help="the trainer's --activation-checkpointing: each decoder layer recomputed in the "
        "backward pass",
    )
    parser.add_argument(
        "--max-tokens-per-micro-batch",
        type=int,
        default=0,
        help="the trainer's token budget per pass (0 = none: --micro-batch-size rows)",
    )
    parser.add_argument(
        "--memory",
        choices=("fast", "small"),
        default="fast",
        help="the trainer's --memory plan (trainer/memory.py): small adds checkpointing, "
        "passes of 256 tokens where no budget or row count is set, 32-position log-prob "
        "chunks, feed-forward blocks 512 positions at a time in longer passes, and fp8 AdamW "
        "moments with --dtype float32 (the trainer's auto picks by the checkpoint's size; "
        "this model is built in memory, so it is named here)",
    )
    args = parser.parse_args(argv)
    try:
        args.micro_batch_sizes = [int(x) for x in str(args.micro_batch_size).split(",") if x]
    except ValueError:
        parser.error(f"--micro-batch-size {args.micro_batch_size!r}: integers, comma separated")
    if not args.micro_batch_sizes or min(args.micro_batch_sizes) < 0:
        parser.error("--micro-batch-size: integers >= 0")
    for name in ("steps", "warmup", "prompt_len", "response_len", "groups", "group_size"):
        low = 0 if name == "warmup" else 1
        if getattr(args, name) < low:
            parser.error(f"--{name.replace('_', '-')} must be >= {low}")
    if args.group_size < 2:
        parser.error("--group-size must be >= 2 (GRPO advantages need two members)")
    if not 0 <= args.length_jitter < 1:
        parser.error("--length-jitter must be in [0, 1)")
    return args


def ensure_msgpack() -> bool:
    """The schemas package imports msgpack at import time but this benchmark never uses it:
    stand a stub in for it where it is not installed. True when the stub was used."""
    if importlib.util.find_spec("msgpack") is not None:
        return False
    stub = types.ModuleType("msgpack")

    def _absent(*_args, **_kwargs):
        raise RuntimeError("msgpack is not installed (gpu_grpo_step.py stub)")

    stub.packb = stub.unpackb = _absent
    for name in ("ExtraData", "FormatError", "StackError"):
        setattr(stub, name, type(name, (ValueError,), {}))
    sys.modules["msgpack"] = stub
    return True


def build_model(shape: dict, dtype, device, seed: int):
    """A random-initialised Qwen2ForCausalLM, created directly on ``device`` in ``dtype``
    (as from_pretrained(dtype=...) would: the RoPE inv_freq buffer stays float32)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**shape)
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    model.train()
    return model


def synthetic_samples(args, vocab: int, eos: int):
    """--groups x --group-size trajectories: one random prompt per group, a random response per
    member, log-probs near the random model's (about -ln V), 0/1 rewards -> GRPO advantages."""
    import random

    import torch

    from agentarium.schemas import LLMCall, Trajectory
    from agentarium.trainer.batch import Sample, advantages

    rng = random.Random(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    def length(mean: int) -> int:
        j = args.length_jitter
        return max(1, rng.randint(round(mean * (1 - j)), round(mean * (1 + j))))

    base = -math.log(vocab)
    samples = []
    for g in range(args.groups):
        prompt = torch.randint(0, vocab, (length(args.prompt_len),), generator=gen).tolist()
        rewards = [float(rng.random() < 0.5) for _ in range(args.group_size)]
        advs = advantages(rewards)
        for i in range(args.group_size):
            n = length(args.response_len)
            response = torch.randint(0, vocab, (n,), generator=gen).tolist()
            finish = "length" if n >= args.response_len else "stop"
            if finish == "stop":
                response[-1] = eos
            logprobs = [min(base + rng.gauss(0.0, 0.1), -1e-3) for _ in range(n)]
            call = LLMCall(
                prompt_ids=prompt,
                response_ids=response,
                response_logprobs=logprobs,
                finish_reason=finish,
                weight_version="bench",
                temperature=1.0,
            )
            traj = Trajectory(
                job_id=f"bench-g{g}-s{i}",
                agent="bench",
                task_id=f"t{g}",
                group_id=f"g{g}",
                sample_index=i,
                group_size=args.group_size,
                run="bench",
                status="ok",
                reward=rewards[i],
                calls=[call],
            )
            samples.append(Sample(traj, advs[i]))
    return samples


def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_config(args, mbs, model, batch, model_dir, device, started, flops_per_step):
    """Warm-up plus timed steps of LocalUpdater.step with micro-batch size ``mbs``."""
    import torch

    from agentarium.trainer.config import TrainerConfig
    from agentarium.trainer.step import LocalUpdater, StepSettings, make_optimizer

    config = TrainerConfig(
        run="bench",
        agent="bench",
        model_dir=str(model_dir),
        group_size=args.group_size,
        groups_per_step=args.groups,
        micro_batch_size=mbs,
        device=device.type,
        seed=args.seed,
        bf16_autocast=args.bf16_autocast,
        pack_rows=args.pack_rows,
        activation_checkpointing=args.activation_checkpointing,
        max_tokens_per_micro_batch=args.max_tokens_per_micro_batch,
        memory=args.memory,
        # fp8 moments are for fp32 weights (trainer/optim.py): the bf16 model keeps fp32 ones
        optimizer_state="auto" if args.dtype == "float32" else "fp32",
    )
    settings = StepSettings.from_config(config)
    # LocalUpdater around the in-memory model (its __init__ would load model_dir in float32).
    updater = LocalUpdater.__new__(LocalUpdater)
    updater.settings = settings
    updater.device = device
    updater.model = model
    updater.ref_model = None  # kl_coef is 0 by default: no reference model
    updater.optimizer = make_optimizer(model, settings)

    micros = list(
        batch.micro_batches(
            mbs, max_tokens=settings.max_tokens_per_micro_batch, packed=settings.pack_rows
        )
    )
    result = {
        "micro_batch_size": mbs,
        "micro_batches": len(micros),
        # positions the forward pass computes: the real tokens when packed; padded, each
        # micro-batch trimmed to its longest row
        "computed_positions": sum(
            m.tokens if args.pack_rows else int(m.input_ids.numel()) for m in micros
        ),
    }
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    times, stats = [], None
    try:
        for step in range(args.warmup + args.steps):
            timed = step >= args.warmup
            if timed and times:
                elapsed = time.perf_counter() - started
                if elapsed + max(times) > args.time_budget:
                    result["stopped_early"] = f"time budget {args.time_budget:.0f} s"
                    break
            sync(device)
            t0 = time.perf_counter()
            stats = updater.step(batch, seed=step + 1)
            sync(device)
            dt = time.perf_counter() - t0
            if timed:
                times.append(dt)
            else:
                result.setdefault("warmup_s", []).append(round(dt, 4))
    except torch.cuda.OutOfMemoryError as exc:
        result["error"] = f"out of memory: {str(exc).splitlines()[0]}"
    finally:
        if device.type == "cuda":
            result["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated(device) / GIB, 3)
            result["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved(device) / GIB, 3)
        updater.optimizer.zero_grad(set_to_none=True)
        del updater
    if times:
        median = statistics.median(times)
        result.update(
            steps_timed=len(times),
            step_s_median=round(median, 4),
            step_s_min=round(min(times), 4),
            step_s_max=round(max(times), 4),
            tokens_per_s=round(batch.tokens / median, 1),
            loss_tokens_per_s=round(batch.model_tokens / median, 1),
            approx_tflops=round(flops_per_step / median / 1e12, 2),
        )
    if stats is not None:
        last = stats.to_dict()
        result["last_step"] = {
            k: round(v, 6) if isinstance(v, float) else v for k, v in last.items()
        }
        result["finite"] = all(math.isfinite(last[k]) for k in ("loss", "grad_norm"))
    return result


def _gib(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}"


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing below downloads; make sure of it
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import torch
    import transformers

    notes = []
    device_name = args.device
    if device_name == "cuda" and not torch.cuda.is_available():
        msg = (
            f"CUDA is not available (torch {torch.__version__}, built for CUDA "
            f"{torch.version.cuda}): falling back to --device cpu"
        )
        if not args.tiny:
            msg += " and --tiny (a 0.5B model takes minutes per step on CPU)"
            args.tiny = True
        print(f"WARNING: {msg}", file=sys.stderr, flush=True)
        notes.append(msg)
        device_name = "cpu"
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    if ensure_msgpack():
        notes.append("msgpack not installed: stubbed (never used by the step)")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from agentarium.trainer.batch import build_rows, collate

    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[args.dtype]
    shape = TINY_SHAPE if args.tiny else FULL_SHAPE
    t0 = time.perf_counter()
    model = build_model(shape, dtype, device, args.seed)
    if args.pack_rows:  # as the trainer's load_policy sets its policy up
        from agentarium.trainer import packing

        packing.enable(model)
    if args.activation_checkpointing or args.memory == "small":  # as the trainer's settings
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )
    sync(device)
    build_model_s = time.perf_counter() - t0
    n_params = sum(p.numel() for p in model.parameters())
    n_matmul = n_params - model.get_input_embeddings().weight.numel()
    weights_gib = torch.cuda.memory_allocated(device) / GIB if device.type == "cuda" else None
    param_dtypes = sorted({str(p.dtype).removeprefix("torch.") for p in model.parameters()})

    cfg = model.config
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
    pad_id = int(cfg.pad_token_id if cfg.pad_token_id is not None else (eos or 0))
    samples = synthetic_samples(args, cfg.vocab_size, eos)
    t0 = time.perf_counter()
    rows, _ = build_rows(samples)
    batch = collate(rows, pad_id=pad_id)
    build_batch_s = time.perf_counter() - t0
    lengths = batch.attention_mask.sum(-1).tolist()
    layers, hidden = cfg.num_hidden_layers, cfg.hidden_size
    flops = 6 * n_matmul * batch.tokens + sum(6 * layers * hidden * n * n for n in lengths)

    info = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "model": "tiny" if args.tiny else "qwen2.5-0.5b-shape (untied)",
        "dtype": args.dtype,
        "param_dtypes": param_dtypes,
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "params": n_params,
        "weights_gib": round(weights_gib, 3) if weights_gib is not None else None,
        "tf32": device.type == "cuda",
        "groups": args.groups,
        "group_size": args.group_size,
        "rows": batch.rows,
        "padded_positions": int(batch.input_ids.numel()),
        "max_len": int(batch.input_ids.shape[1]),
        "tokens": batch.tokens,
        "loss_tokens": batch.model_tokens,
        "prompt_len": args.prompt_len,
        "response_len": args.response_len,
        "length_jitter": args.length_jitter,
        "approx_flops_per_step": flops,
        "build_model_s": round(build_model_s, 3),
        "build_rows_collate_s": round(build_batch_s, 4),
        "warmup": args.warmup,
        "steps": args.steps,
        "optimizer": "AdamW (trainer defaults: lr 1e-5, betas 0.9/0.999, wd 0, clip 1.0)",
        "gradient_checkpointing": args.activation_checkpointing or args.memory == "small",
        "memory": args.memory,
        "pack_rows": args.pack_rows,
        "max_tokens_per_micro_batch": args.max_tokens_per_micro_batch,
        "notes": notes,
    }
    print(
        f"{info['device']} | torch {info['torch']} | transformers {info['transformers']} | "
        f"{info['model']} {n_params / 1e6:.1f}M params {args.dtype} ({info['attn_implementation']})"
    )
    print(
        f"batch {batch.rows} rows ({args.groups} groups x {args.group_size}), "
        f"{batch.tokens} tokens ({batch.model_tokens} loss tokens), max len {info['max_len']}, "
        f"padded {info['padded_positions']}; model built {build_model_s:.1f} s, "
        f"rows+collate {build_batch_s * 1000:.0f} ms",
        flush=True,
    )

    results = []
    with tempfile.TemporaryDirectory() as model_dir:
        cfg.save_pretrained(model_dir)  # config.json only: TrainerConfig checks it exists
        for mbs in args.micro_batch_sizes:
            if results and time.perf_counter() - started > args.time_budget:
                results.append({"micro_batch_size": mbs, "error": "skipped: time budget spent"})
                continue
            results.append(run_config(args, mbs, model, batch, model_dir, device, started, flops))

    header = (
        f"{'micro':>6}{'step s (med)':>14}{'min':>9}{'tokens/s':>12}{'loss tok/s':>12}"
        f"{'~TFLOP/s':>10}{'peak alloc GiB':>16}{'peak resv GiB':>15}"
    )
    print(header)
    for r in results:
        if "step_s_median" not in r:
            print(f"{r['micro_batch_size']:>6}  {r.get('error', 'no timed step')}")
            continue
        print(
            f"{r['micro_batch_size']:>6}{r['step_s_median']:>14.3f}{r['step_s_min']:>9.3f}"
            f"{r['tokens_per_s']:>12.0f}{r['loss_tokens_per_s']:>12.0f}{r['approx_tflops']:>10.1f}"
            f"{_gib(r.get('peak_allocated_gib')):>16}{_gib(r.get('peak_reserved_gib')):>15}"
        )
    info["total_s"] = round(time.perf_counter() - started, 2)
    report = {"bench": "gpu_grpo_step", **info, "results": results}
    line = json.dumps(report, separators=(",", ":"))
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        path = Path(out) / "gpu_grpo_step.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path}")
    ok = all(r.get("finite", False) and "error" not in r for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
