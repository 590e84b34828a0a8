"""The local engine vs vLLM's CPU build: generated tokens/s and time to first token, one run.

Both serve the same model directory (SmolLM2-135M-Instruct by default, fp32) as servers of their
own, started as a user starts them: ``agentarium engine --threads T --max-batch 64`` and
``agentarium engine --backend vllm`` (vLLM's virtualenv: ops/vllm_venv.sh), each computing on
``--threads`` threads (vLLM's ``VLLM_CPU_OMP_THREADS_BIND=0-(threads-1)``). Each is called the way a rollout consumer calls it, through the consumer's own
backends (``SGLangBackend`` on ``/generate``, ``VLLMBackend`` on ``/inference/v1/generate``):
token ids in, token ids and log-probs out.

For each batch size B (default 1, 8, 32, 64) the same B chat prompts (bench/engine_batching.py's)
are sent at once, each asking for ``--tokens`` new tokens at temperature 1 with EOS ignored, so
every row costs the same on both sides; generated tokens/s = B x tokens / the time from the first
send to the last reply. Time to first token: the same B prompts asking for one token each, the
time until the last of them answered (these clients do not stream, so the first
token of a request is the whole of a one-token request: queueing, prefill and one sample). The two
servers take turns, the order flipped every round, ``--repeat`` rounds after a warm-up of each,
``--settle`` seconds between turns (a server that just finished can keep threads spinning
for a while on the cores the other needs); both stay up the whole run. Prints the median and range of
each figure side by side, and local / vLLM.

    PYTHONPATH=. python bench/engine_vs_vllm.py [--model smol|tiny|DIR] [--batches 1,8,32,64]
        [--tokens 32] [--repeat 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

from engine_batching import prompts  # the same chat prompts (bench/ is the script's path)

from agentarium.consumers.backends import GenerateRequest, SGLangBackend, VLLMBackend
from agentarium.formats import ChatTemplate
from agentarium.models import resolve_model

READY = re.compile(r"engine ready on (http://\S+)")


def start(
    argv: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen, str]:
    """``agentarium ARGV`` until it prints its URL; the process and the URL."""
    with log.open("w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "agentarium", *argv],
            env={**os.environ, **(env or {})},
            stdout=subprocess.PIPE,
            stderr=sink,
            text=True,
            start_new_session=True,
        )
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    for line in proc.stdout:
        found = READY.search(line)
        if found:
            # keep reading: a server whose stdout pipe fills (vLLM's access log) blocks on it
            threading.Thread(target=_drain, args=(proc.stdout, log), daemon=True).start()
            return proc, found.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise SystemExit(f"{' '.join(argv)} did not start; its log: {log}")


def _drain(stream, log: Path) -> None:
    with log.open("a") as sink:
        for line in stream:
            sink.write(line)


async def timed(backend, batch: list[list[int]], tokens: int) -> float:
    """Seconds from sending ``batch`` at once to the last reply; every reply checked."""
    sampling = {"max_new_tokens": tokens, "temperature": 1.0, "ignore_eos": True}
    started = time.perf_counter()
    results = await asyncio.gather(
        *(
            backend.generate(GenerateRequest(input_ids=list(ids), sampling=dict(sampling)))
            for ids in batch
        )
    )
    seconds = time.perf_counter() - started
    for result in results:
        assert len(result.output_ids) == tokens == len(result.output_logprobs), result
    return seconds


def spread(values: list[float], fmt: str = ".0f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


async def main(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model)
    sizes = [int(b) for b in args.batches.split(",")]
    logs = Path(args.logs)
    logs.mkdir(parents=True, exist_ok=True)
    local_proc, local_url = start(
        ["engine", "--model", str(model_dir), "--port", "0", "--threads", str(args.threads),
         "--max-batch", str(max(sizes))],
        logs / "local.log", 300,
    )  # fmt: skip
    # vLLM's CPU build binds one OpenMP thread per core it is given; left to itself ("auto")
    # it keeps one core of two for its API server and computes on the other
    vllm_proc, vllm_url = start(
        ["engine", "--backend", "vllm", "--model", str(model_dir), "--port", "0"],
        logs / "vllm.log", 600, {"VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}"},
    )  # fmt: skip
    template = ChatTemplate.from_model_dir(model_dir)
    all_prompts = prompts(max(sizes), template.tokenizer)
    sides = {
        "local": SGLangBackend(local_url),
        "vllm": VLLMBackend(vllm_url, decode=template.decode),
    }
    rate: dict[tuple[str, int], list[float]] = {(s, b): [] for s in sides for b in sizes}
    first: dict[tuple[str, int], list[float]] = {(s, b): [] for s in sides for b in sizes}
    try:
        for backend in sides.values():  # warm-up: every batch size once
            for b in sizes:
                await timed(backend, all_prompts[:b], 4)
        for round_ in range(args.repeat):
            order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
            for b in sizes:
                batch = all_prompts[:b]
                for side in order:
                    await asyncio.sleep(args.settle)  # the other server's idle threads stop
                    seconds = await timed(sides[side], batch, args.tokens)
                    rate[side, b].append(b * args.tokens / seconds)
                    first[side, b].append(await timed(sides[side], batch, 1))
            print(f"round {round_ + 1}/{args.repeat} done", flush=True)
    finally:
        for backend in sides.values():
            await backend.aclose()
        for proc in (local_proc, vllm_proc):
            os.killpg(proc.pid, 15)
            proc.wait(60)
    prompt_len = statistics.mean(len(p) for p in all_prompts)
    print(
        f"{model_dir.name}: {args.tokens} new tokens a row (EOS ignored), prompts ~{prompt_len:.0f} "
        f"tokens, {args.threads} compute threads each (local --threads, vLLM "
        f"VLLM_CPU_OMP_THREADS_BIND=0-{args.threads - 1}); {args.repeat} rounds, median (range)"
    )
    print(
        f"{'batch':>5} {'local tok/s':>16} {'vLLM tok/s':>16} {'local/vLLM':>10} "
        f"{'local TTFT s':>18} {'vLLM TTFT s':>18}"
    )
    for b in sizes:
        lo, vl = rate["local", b], rate["vllm", b]
        print(
            f"{b:>5} {spread(lo):>16} {spread(vl):>16} "
            f"{statistics.median(lo) / statistics.median(vl):>10.2f} "
            f"{spread(first['local', b], '.3f'):>18} {spread(first['vllm', b], '.3f'):>18}"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smol", help="'smol', 'tiny' or a model directory")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2, help="compute threads of each server")
    parser.add_argument("--logs", default="/tmp/engine_vs_vllm", help="the servers' logs")
    parser.add_argument(
        "--settle",
        type=float,
        default=2.0,
        help="seconds between one side's run and the other's: a server that just finished may "
        "keep its threads spinning a while, on the cores the other one needs",
    )
    asyncio.run(main(parser.parse_args()))
