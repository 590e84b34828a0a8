"""Per-call latency through the gateway vs a direct ``llm.chat``, streamed and not:
``python bench/gateway_overhead.py [--calls 200] [--rounds 5] [--reply-chars 200]``.

One ``TracingLLM`` (the tiny model's chat template) on an instant SGLang-shaped engine in its own
process (bench/fake_fleet.py, its reply ``--reply-chars`` long) is called ``--calls`` times in a
row per mode: directly, and over HTTP through the rollout's endpoint as Chat Completions,
Responses and Anthropic Messages, each with and without ``stream``, plus the openai SDK's
streamed chat as agents call it. The HTTP client is a bare aiohttp session with keep-alive
(reading each whole body), so the figure is the gateway's: HTTP, translation, the call, the
reply or its events. The modes take turns within each round, in an order rotated every round,
after one warm-up round; medians and 90th percentiles over all rounds' calls.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import aiohttp  # noqa: E402
import openai  # noqa: E402

from agentarium.consumers.backends import SGLangBackend  # noqa: E402
from agentarium.consumers.tracing.llm import TracingLLM  # noqa: E402
from agentarium.consumers.tracing.proxy import TracingProxy  # noqa: E402
from agentarium.formats.chat_template import ChatTemplate  # noqa: E402
from agentarium.schemas import Sampling  # noqa: E402
from agentarium.tiny import ensure_tiny_model  # noqa: E402

QUESTION = [{"role": "user", "content": "What is 2+3?"}]
Call = Callable[[], Awaitable[object]]


def start_engine(reply_chars: int) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "fake_fleet.py"), "--text", "x" * reply_chars],
        stdout=subprocess.PIPE,
        text=True,
    )
    return proc, proc.stdout.readline().split(" on ", 1)[1].strip()  # type: ignore[union-attr]


def modes(llm: TracingLLM, endpoint: str, http: aiohttp.ClientSession) -> dict[str, Call]:
    def post(path: str, body: dict) -> Call:
        async def call() -> bytes:
            async with http.post(endpoint + path, json=body) as response:
                data = await response.read()
                assert response.status == 200, data[:200]
                return data

        return call

    chat = {"model": "tiny", "messages": QUESTION}
    responses = {"model": "tiny", "input": QUESTION}
    messages = {"model": "tiny", "messages": QUESTION, "max_tokens": 1024}
    sdk = openai.AsyncOpenAI(base_url=endpoint, api_key="unused", max_retries=0)

    async def sdk_stream() -> None:
        stream = await sdk.chat.completions.create(model="tiny", messages=QUESTION, stream=True)
        async for _ in stream:
            pass

    return {
        "direct llm.chat": lambda: llm.chat(QUESTION),
        "chat completions": post("/chat/completions", chat),
        "chat completions, stream": post("/chat/completions", {**chat, "stream": True}),
        "responses": post("/responses", responses),
        "responses, stream": post("/responses", {**responses, "stream": True}),
        "messages": post("/messages", messages),
        "messages, stream": post("/messages", {**messages, "stream": True}),
        "chat stream, openai SDK": sdk_stream,
    }


async def timed(call: Call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        await call()
        out.append(time.perf_counter() - start)
    return out


async def main(calls: int, rounds: int, reply_chars: int) -> None:
    proc, url = start_engine(reply_chars)
    template = ChatTemplate.from_model_dir(ensure_tiny_model())
    backend = SGLangBackend([url])
    proxy = TracingProxy(host="127.0.0.1")
    await proxy.start()
    llm = TracingLLM(backend, template, Sampling(max_new_tokens=1024), "g", "bench", "tiny")
    llm.record_messages = False
    try:
        async with aiohttp.ClientSession() as http:
            with proxy.register("bench", llm) as endpoint:
                table = modes(llm, endpoint, http)
                names = list(table)
                for name in names:  # warm-up: connections, the SDK's types, the template cache
                    await timed(table[name], 10)
                seen: dict[str, list[float]] = {name: [] for name in names}
                for r in range(rounds):
                    order = names[r % len(names) :] + names[: r % len(names)]
                    for name in order:
                        seen[name] += await timed(table[name], calls)
                    llm.calls.clear()
    finally:
        await proxy.close()
        await backend.aclose()
        proc.terminate()
    direct = statistics.median(seen[names[0]])
    print(f"{calls} calls x {rounds} rounds per mode, reply of {reply_chars} characters")
    print("| mode | median | p90 | over direct |")
    print("|---|---|---|---|")
    for name in names:
        values = sorted(seen[name])
        median = statistics.median(values)
        p90 = values[int(0.9 * (len(values) - 1))]
        extra = "" if name == names[0] else f"+{(median - direct) * 1e3:.2f} ms"
        print(f"| {name} | {median * 1e3:.2f} ms | {p90 * 1e3:.2f} ms | {extra} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--calls", type=int, default=200, help="calls per mode per round")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reply-chars", type=int, default=200, help="length of every reply")
    args = parser.parse_args()
    asyncio.run(main(args.calls, args.rounds, args.reply_chars))
