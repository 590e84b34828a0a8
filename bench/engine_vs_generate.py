"""Local engine vs transformers' own ``generate``: generated tokens/s on the same prompts.

For each batch size (default 1, 8, 32, 64), the same B chat prompts (token ids) get
``--tokens`` new tokens each, EOS ignored so every row costs the same, sampled at temperature
1: once through the local engine's HTTP API (B requests at once, continuous batching into
shared forward passes, KV cache) and once through ``model.generate`` of the same model
directory in this process (one left-padded batch of B, transformers' own KV cache). Both use
``--threads`` torch threads. The two take turns, ``--repeat`` rounds per batch size after a
warm-up of each; prints the median and range of generated tokens/s side by side.

    PYTHONPATH=. python bench/engine_vs_generate.py [--model smol|tiny|DIR] [--batches 1,8,32,64]
        [--tokens 32] [--repeat 5] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import aiohttp
import torch
from engine_batching import prompts  # the same chat prompts (bench/ is the script's path)
from transformers import AutoModelForCausalLM

from agentarium.inference.engine import LocalEngine, start_server
from agentarium.models import resolve_model


async def engine_tokens_per_s(url: str, batch: list[list[int]], tokens: int) -> float:
    async with aiohttp.ClientSession(base_url=url) as http:

        async def one(ids: list[int], seed: int) -> int:
            body = {
                "input_ids": ids,
                "sampling_params": {
                    "max_new_tokens": tokens,
                    "temperature": 1.0,
                    "ignore_eos": True,
                    "sampling_seed": seed,
                },
            }
            async with http.post("/generate", json=body) as resp:
                resp.raise_for_status()
                return int((await resp.json())["meta_info"]["completion_tokens"])

        started = time.perf_counter()
        made = await asyncio.gather(*(one(ids, i) for i, ids in enumerate(batch)))
        return sum(made) / (time.perf_counter() - started)


def generate_tokens_per_s(model, batch: list[list[int]], tokens: int, pad_id: int) -> float:
    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad_id] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad_id,
        )
    seconds = time.perf_counter() - started
    made = (out.shape[1] - width) * len(batch)
    assert made == tokens * len(batch), (made, tokens, len(batch))
    return made / seconds


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):>8.0f} ({min(values):.0f}-{max(values):.0f})"


async def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    model_dir = resolve_model(args.model)
    sizes = [int(b) for b in args.batches.split(",")]
    engine = LocalEngine(model_dir, threads=args.threads, max_batch=max(sizes))
    server = await start_server(engine, "127.0.0.1", 0)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    pad_id = hf.generation_config.pad_token_id or hf.generation_config.eos_token_id or 0
    if isinstance(pad_id, list):
        pad_id = pad_id[0]
    all_prompts = prompts(max(sizes), engine.model.tokenizer)
    results: dict[int, dict[str, list[float]]] = {b: {"engine": [], "generate": []} for b in sizes}
    try:
        await engine_tokens_per_s(server.url, all_prompts[:4], 4)  # warm-up, both sides
        generate_tokens_per_s(hf, all_prompts[:4], 4, pad_id)
        for round_ in range(args.repeat):
            for b in sizes:
                batch = all_prompts[:b]
                order = ("engine", "generate") if round_ % 2 == 0 else ("generate", "engine")
                for mode in order:
                    if mode == "engine":
                        v = await engine_tokens_per_s(server.url, batch, args.tokens)
                    else:
                        v = generate_tokens_per_s(hf, batch, args.tokens, pad_id)
                    results[b][mode].append(v)
            print(f"round {round_ + 1}/{args.repeat} done", flush=True)
    finally:
        await server.close()
    prompt_len = statistics.mean(len(p) for p in all_prompts)
    print(
        f"{model_dir.name}: {args.tokens} new tokens a row (EOS ignored), prompts ~{prompt_len:.0f} "
        f"tokens, torch threads {args.threads}, {args.repeat} rounds, median (range) tokens/s"
    )
    print(f"{'batch':>5} {'local engine':>22} {'transformers generate':>24} {'ratio':>6}")
    for b in sizes:
        e, g = results[b]["engine"], results[b]["generate"]
        ratio = statistics.median(e) / statistics.median(g)
        print(f"{b:>5} {spread(e):>22} {spread(g):>24} {ratio:>6.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smol", help="'smol', 'tiny' or a model directory")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    asyncio.run(main(parser.parse_args()))
