"""A burst of prompts that start alike on the local engine: their common prefix computed once
(the prefix cache on, its default size) against every row computing its own (the prefix cache
off, ``--prefix-cache-tokens 0``, which is what the engine did for any burst before prompts of
one prefill shared their prefix: the cache only served later arrivals).

The prompts are the calculator recipe's first turns (examples/calculator_agent.py, rendered as
its consumer renders them: SmolLM2's template with the tool in the system message, the three
solved examples, the question): --tasks held-out problems, --k rows each, as an eval or a
training step sends them. Each side gets a fresh engine (load not timed) and generates up to
--tokens tokens a row at temperature 1; the sides alternate, which goes first alternating too,
--repeats times; medians and ranges printed, with the prompt tokens each side computed.

    python bench/engine_shared_prefix.py [--tasks 8] [--k 4] [--tokens 40] [--repeats 5]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from agentarium.inference.engine import LocalEngine
from agentarium.smol import ensure_smol_model


def calc_prompts(model, tasks: int, k: int) -> list[list[int]]:
    from langchain_core.messages import convert_to_openai_messages
    from langchain_core.utils.function_calling import convert_to_openai_tool

    from agentarium.examples import calculator_agent as calc
    from agentarium.formats.chat_template import ChatTemplate
    from agentarium.formats.tool_fallback import with_tools_in_text

    template = ChatTemplate.from_model_dir(model)
    tool = convert_to_openai_tool(calc.calculator_tool())
    prompts = []
    for task in calc.eval_tasks()[:tasks]:
        question = calc.QUESTION.format(a=task["a"], op=task["op"], b=task["b"])
        messages = convert_to_openai_messages(calc.history(question))
        prompts += [template.encode_chat(with_tools_in_text(messages, [tool]))] * k
    return prompts


async def burst(model, prompts, *, cache_tokens: int, tokens: int, threads: int):
    async with LocalEngine(model, prefix_cache_tokens=cache_tokens, threads=threads) as engine:
        sampling = {"max_new_tokens": tokens, "temperature": 1.0}
        started = time.perf_counter()
        outs = await asyncio.gather(
            *(engine.generate({"input_ids": ids, "sampling_params": sampling}) for ids in prompts)
        )
        seconds = time.perf_counter() - started
    computed = sum(o["meta_info"]["prompt_tokens"] - o["meta_info"]["cached_tokens"] for o in outs)
    return seconds, computed, sum(o["meta_info"]["completion_tokens"] for o in outs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=8, help="held-out problems")
    parser.add_argument("--k", type=int, default=4, help="rows per problem")
    parser.add_argument("--tokens", type=int, default=40, help="most new tokens a row")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of both sides")
    parser.add_argument("--threads", type=int, default=1, help="the engine's torch threads")
    args = parser.parse_args()
    model = ensure_smol_model()
    prompts = calc_prompts(model, args.tasks, args.k)
    print(f"{len(prompts)} prompts of {len(prompts[0])} tokens, {args.threads} thread(s)")
    sides = {"each row its own (cache off)": 0, "common prefix once (cache on)": 32768}
    times: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(args.repeats):
        order = list(sides) if round_ % 2 == 0 else list(reversed(sides))
        for name in order:
            seconds, computed, generated = asyncio.run(
                burst(
                    model,
                    prompts,
                    cache_tokens=sides[name],
                    tokens=args.tokens,
                    threads=args.threads,
                )
            )
            times[name].append(seconds)
            print(
                f"round {round_}: {name}: {seconds:.1f} s, {computed} prompt tokens computed, "
                f"{generated} generated",
                flush=True,
            )
    for name, values in times.items():
        print(
            f"{name}: median {statistics.median(values):.1f} s "
            f"({min(values):.1f}-{max(values):.1f}), {len(values)} runs"
        )


if __name__ == "__main__":
    main()
