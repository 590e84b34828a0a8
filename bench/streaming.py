"""Streaming through the gateway, live vs written from the finished call: time to first text and
to the end for each API, and what streaming costs in throughput. One run:

    PYTHONPATH=. python bench/streaming.py [--model smol|tiny|DIR] [--tokens 64] [--batch 16]
        [--repeat 5] [--threads 2]

One local engine (``agentarium engine``, its own process, ``--threads`` compute threads) serves
the model; one gateway (``TracingProxy``) in this process serves two rollout endpoints on it,
each a ``TracingLLM`` on the consumer's ``SGLangBackend``: "live" streams ``/generate`` and hands
each sure piece of text on as it comes (what agents get now), "whole" is the same backend with
streaming off, so each API's events are written once the call is over (what they got before).

- Latency: for each API (Chat Completions, Responses, Anthropic Messages) one ``stream: true``
  request at a time, read with aiohttp: the time to the first event that carries reply text
  and to the stream's end. Greedy sampling, so both modes generate the same ``--tokens`` tokens
  (a reply that ends sooner is shorter in both alike).
- Throughput: ``--batch`` streamed Chat Completions requests at once; completion tokens / wall.

The modes take turns, the order flipped every round, ``--repeat`` rounds after a warm-up;
median and range of each figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from engine_vs_vllm import start  # the same server start (bench/ is the script's path)

from agentarium.consumers.backends import SGLangBackend
from agentarium.consumers.tracing.llm import TracingLLM
from agentarium.consumers.tracing.proxy import TracingProxy
from agentarium.formats import ChatTemplate
from agentarium.models import resolve_model
from agentarium.schemas import Sampling

QUESTION = "Write a short story about a robot who learns to paint. Use simple words."
PATHS = {"chat": "/chat/completions", "responses": "/responses", "messages": "/messages"}


class WholeBackend(SGLangBackend):
    """The consumer's backend with streaming off: the gateway writes each reply at its end."""

    streams = False


def body(api: str, tokens: int) -> dict:
    messages = [{"role": "user", "content": QUESTION}]
    if api == "chat":
        return {"model": "m", "messages": messages, "max_tokens": tokens, "temperature": 0,
                "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    if api == "responses":
        return {"model": "m", "input": messages, "max_output_tokens": tokens, "temperature": 0,
                "stream": True}  # fmt: skip
    return {"model": "m", "messages": messages, "max_tokens": tokens, "temperature": 0,
            "stream": True}  # fmt: skip


def has_text(api: str, data: dict) -> bool:
    """Whether one event carries reply text."""
    if api == "chat":
        choices = data.get("choices") or []
        return bool(choices and choices[0]["delta"].get("content"))
    if api == "responses":
        return data.get("type") == "response.output_text.delta"
    return data.get("type") == "content_block_delta"


def output_tokens(api: str, data: dict) -> int | None:
    if api == "chat" and data.get("usage"):
        return data["usage"]["completion_tokens"]
    return None


async def one(http: aiohttp.ClientSession, url: str, api: str, tokens: int) -> tuple:
    """(seconds to the first text, seconds to the end, completion tokens)."""
    start_t = time.perf_counter()
    first = None
    used = 0
    async with http.post(url + PATHS[api], json=body(api, tokens)) as response:
        assert response.status == 200, await response.text()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            data = json.loads(line[6:])
            if first is None and has_text(api, data):
                first = time.perf_counter() - start_t
            used = output_tokens(api, data) or used
    return first, time.perf_counter() - start_t, used


async def throughput(http, url: str, batch: int, tokens: int) -> float:
    start_t = time.perf_counter()
    done = await asyncio.gather(*(one(http, url, "chat", tokens) for _ in range(batch)))
    return sum(used for _, _, used in done) / (time.perf_counter() - start_t)


def summary(values: list[float], scale: float = 1.0, fmt: str = "{:.3f}") -> str:
    scaled = [v * scale for v in values]
    median = statistics.median(scaled)
    return f"{fmt.format(median)} ({fmt.format(min(scaled))}-{fmt.format(max(scaled))})"


async def main(args: argparse.Namespace) -> None:
    model_dir = resolve_model(args.model)
    template = ChatTemplate.from_model_dir(model_dir)
    logs = Path(tempfile.mkdtemp(prefix="bench-streaming-"))
    argv = ["engine", "--model", str(model_dir), "--port", "0",
            "--threads", str(args.threads), "--max-batch", "64"]  # fmt: skip
    proc, url = start(argv, logs / "engine.log", 600.0)
    backends = {"live": SGLangBackend([url]), "whole": WholeBackend([url])}
    proxy = TracingProxy(host="127.0.0.1")
    await proxy.start()
    job = Sampling(max_new_tokens=args.tokens, temperature=0.0)
    llms = {mode: TracingLLM(b, template, job, "g", mode, "m") for mode, b in backends.items()}
    for llm in llms.values():
        llm.record_messages = False
    first: dict = {(api, m): [] for api in PATHS for m in llms}
    last: dict = {(api, m): [] for api in PATHS for m in llms}
    rate: dict = {m: [] for m in llms}
    try:
        async with aiohttp.ClientSession() as http:
            with (
                proxy.register("live", llms["live"]) as live,
                proxy.register("whole", llms["whole"]) as whole,
            ):
                urls = {"live": live, "whole": whole}
                for mode in urls:  # warm-up
                    for api in PATHS:
                        await one(http, urls[mode], api, args.tokens)
                    await throughput(http, urls[mode], args.batch, args.tokens)
                for r in range(args.repeat):
                    order = list(urls) if r % 2 == 0 else list(urls)[::-1]
                    for mode in order:
                        for api in PATHS:
                            f, t, _ = await one(http, urls[mode], api, args.tokens)
                            first[api, mode].append(f)
                            last[api, mode].append(t)
                        rate[mode].append(
                            await throughput(http, urls[mode], args.batch, args.tokens)
                        )
                        llms[mode].calls.clear()
    finally:
        await proxy.close()
        for backend in backends.values():
            await backend.aclose()
        os.killpg(proc.pid, 15)
        proc.wait(60)
    print(f"model {args.model}, {args.tokens} tokens per reply (greedy), {args.threads} threads,"
          f" {args.repeat} rounds; median (range)")  # fmt: skip
    print("| API | first text, live | first text, whole | end, live | end, whole |")
    print("|---|---|---|---|---|")
    for api in PATHS:
        cells = [summary(first[api, m], 1e3, "{:.0f}") + " ms" for m in ("live", "whole")]
        cells += [summary(last[api, m], 1e3, "{:.0f}") + " ms" for m in ("live", "whole")]
        print(f"| {api} | " + " | ".join(cells) + " |")
    ratio = [a / b for a, b in zip(rate["live"], rate["whole"], strict=True)]
    print(f"\nthroughput, {args.batch} streamed chat requests at once (completion tokens/s):")
    print(f"live {summary(rate['live'], 1, '{:.1f}')}, whole {summary(rate['whole'], 1, '{:.1f}')}")
    print(f"live / whole per round: {summary(ratio)}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smol", help="smol, tiny or a model directory")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per reply")
    parser.add_argument("--batch", type=int, default=16, help="requests at once (throughput)")
    parser.add_argument("--repeat", type=int, default=5, help="alternating rounds (>= 1)")
    parser.add_argument("--threads", type=int, default=2, help="the engine's compute threads")
    args = parser.parse_args()
    for name in ("tokens", "batch", "repeat", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    try:
        resolve_model(args.model)  # a wrong name, before the engine starts
    except Exception as exc:  # noqa: BLE001 - whatever it says, it is the user's to fix
        parser.error(f"--model {args.model!r}: {exc}")
    sys.exit(asyncio.run(main(args)))
