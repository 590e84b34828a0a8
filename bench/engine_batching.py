"""Local engine: continuous batching vs one request at a time, in the same run.

N requests (default 64, each 32 new tokens, EOS ignored so every request costs the same) go
through the local engine's HTTP API twice: all at once (batched into shared forward passes)
and one after another (what a user gets from an engine without batching; the engine's
collection window is turned off for that half so it is not charged for waiting). Prints
requests/s and generated tokens/s side by side.

``--otlp`` runs the same with tracing on: the engine's spans (docs/observability.md) exported over
OTLP/HTTP to a receiver in a separate process that reads and discards them, as a collector would.
Comparing a run with and without it is what tracing costs the engine.

    python bench/engine_batching.py [--model tiny|DIR] [--requests 64] [--tokens 32] [--threads 1] [--otlp]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from agentarium.broker import setup_tracing, shutdown_tracing
from agentarium.inference.engine import LocalEngine, start_server
from agentarium.tiny import resolve_model


def prompts(n: int, tokenizer) -> list[list[int]]:
    out = []
    for i in range(n):
        text = (
            "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
            f"<|im_start|>user\nWhat is {17 * i + 3} + {29 * i % 97}?<|im_end|>\n"
            "<|im_start|>assistant\n"
        )
        out.append(tokenizer.encode(text).ids)
    return out


async def run(url: str, bodies: list[dict], *, concurrent: bool) -> tuple[float, int]:
    async with aiohttp.ClientSession(base_url=url) as http:

        async def one(body: dict) -> int:
            async with http.post("/generate", json=body) as resp:
                resp.raise_for_status()
                return (await resp.json())["meta_info"]["completion_tokens"]

        started = time.perf_counter()
        if concurrent:
            counts = await asyncio.gather(*(one(b) for b in bodies))
        else:
            counts = [await one(b) for b in bodies]
        return time.perf_counter() - started, sum(counts)


async def main(args: argparse.Namespace) -> None:
    model = resolve_model(args.model)
    engine = LocalEngine(model, threads=args.threads, max_batch=args.requests)
    server = await start_server(engine, "127.0.0.1", 0)
    try:
        bodies = [
            {
                "input_ids": ids,
                "sampling_params": {
                    "max_new_tokens": args.tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "sampling_seed": i,
                },
                "return_logprob": True,
            }
            for i, ids in enumerate(prompts(args.requests, engine.model.tokenizer))
        ]
        await run(server.url, bodies[:4], concurrent=True)  # warm up
        steps = engine.scheduler.steps
        batched_s, batched_tokens = await run(server.url, bodies, concurrent=True)
        batched_steps = engine.scheduler.steps - steps
        engine.scheduler.batch_window_s = 0.0
        steps = engine.scheduler.steps
        single_s, single_tokens = await run(server.url, bodies, concurrent=False)
        single_steps = engine.scheduler.steps - steps
    finally:
        await server.close()

    n, prompt_len = args.requests, sum(len(b["input_ids"]) for b in bodies) / len(bodies)
    print(
        f"local engine, {Path(model).name}, {n} requests x {args.tokens} new tokens "
        f"(prompt ~{prompt_len:.0f} tokens), torch threads={args.threads}"
    )
    print(f"{'':<22}{'batched':>12}{'one at a time':>16}")
    print(f"{'wall time (s)':<22}{batched_s:>12.2f}{single_s:>16.2f}")
    print(f"{'requests/s':<22}{n / batched_s:>12.1f}{n / single_s:>16.1f}")
    print(
        f"{'generated tokens/s':<22}{batched_tokens / batched_s:>12.0f}{single_tokens / single_s:>16.0f}"
    )
    print(f"{'forward steps':<22}{batched_steps:>12}{single_steps:>16}")
    print(f"speed-up from batching: {single_s / batched_s:.1f}x")


# An OTLP/HTTP sink in its own process: answers every POST 200, counts requests and bytes,
# and prints them when its stdin closes.
_SINK = """
import http.server, sys, threading
seen = [0, 0]
class H(http.server.BaseHTTPRequestHandler):
    def do_POST(self):
        seen[0] += 1; seen[1] += len(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
    def log_message(self, *a): pass
s = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print(s.server_address[1], flush=True)
threading.Thread(target=s.serve_forever, daemon=True).start()
sys.stdin.read()
print(f"{seen[0]} export requests, {seen[1]} bytes", flush=True)
"""


def start_sink() -> subprocess.Popen:
    sink = subprocess.Popen(
        [sys.executable, "-c", _SINK], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert sink.stdout is not None
    os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = f"http://127.0.0.1:{sink.stdout.readline().strip()}"
    return sink


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", help="'tiny' or a transformers model dir")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--otlp", action="store_true", help="trace the engine, exporting to an OTLP/HTTP sink"
    )
    args = parser.parse_args()
    sink = start_sink() if args.otlp else None
    if sink is not None:
        setup_tracing("engine-bench")
    try:
        asyncio.run(main(args))
    finally:
        if sink is not None:
            shutdown_tracing()  # the last spans out before the sink counts
            out, _ = sink.communicate("")
            print(f"tracing on: {out.strip()} to the OTLP sink")
