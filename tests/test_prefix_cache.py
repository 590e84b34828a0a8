"""The local engine's prefix cache: a multi-turn conversation's next turn reuses the KV of the
previous one (``cached_tokens`` in meta_info, as SGLang reports it), with the outputs the
engine gives without it; memory stays within ``--prefix-cache-tokens``; weights that change
empty it."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from agentarium.formats.chat_template import ChatTemplate
from agentarium.inference.engine import EngineSettings, LocalEngine
from agentarium.inference.engine.prefix_cache import PrefixCache
from agentarium.inference.engine.scheduler import SHARE_MIN_TOKENS, _common_length

TURNS = 3


def kv(n: int, value: float = 0.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Keys and values of n tokens for a 2-layer model."""
    return [torch.full((2, n, 4), value)] * 2, [torch.full((2, n, 4), value)] * 2


def test_the_longest_prefix_is_found_and_memory_stays_bounded():
    cache = PrefixCache(20)
    assert cache.lookup([1, 2, 3]) is None
    assert cache.store([1, 2, 3, 4], *kv(4, 1.0), epoch=0)
    assert cache.store([1, 2, 9, 9, 9, 9], *kv(6, 2.0), epoch=0)
    hit = cache.lookup([1, 2, 3, 4, 5])
    assert hit is not None and hit.length == 4 and float(hit.keys[0][0, 0, 0]) == 1.0
    assert cache.lookup([1, 2, 3, 4]).length == 3  # never the whole prompt: its last token runs
    assert cache.lookup([7, 2, 3]) is None
    # A sequence extending an entry replaces it: one entry per conversation.
    assert cache.store([1, 2, 3, 4, 5, 6], *kv(6, 3.0), epoch=0)
    assert len(cache) == 2 and cache.tokens == 12
    assert not cache.store([1, 2, 3], *kv(3), epoch=0)  # already held, inside a longer one
    # Least recently used out: [1, 2, 9, ...] was used last before [1..6] was stored.
    cache.lookup([1, 2, 3, 4, 5, 6, 7])
    assert cache.store([5] * 10, *kv(10), epoch=0)
    assert cache.tokens == 16 and len(cache) == 2
    assert cache.lookup([1, 2, 9, 9, 9, 9, 1]).length == 2  # only [1, 2], of the other entry
    assert cache.lookup([1, 2, 3, 4, 5, 6, 7]).length == 6
    assert not cache.store(list(range(21)), *kv(21), epoch=0)  # bigger than the budget
    # A flush starts a new epoch: KV computed before it is not stored after it.
    cache.flush()
    assert len(cache) == 0 and cache.tokens == 0
    assert not cache.store([1, 2, 3], *kv(3), epoch=0)
    assert cache.store([1, 2, 3], *kv(3), epoch=cache.epoch)
    assert not PrefixCache(0).store([1, 2], *kv(2), epoch=0)  # 0 turns it off


@pytest.fixture(scope="module")
def template(tiny_dir) -> ChatTemplate:
    return ChatTemplate.from_model_dir(tiny_dir)


async def conversations(engine: LocalEngine, template: ChatTemplate, n: int) -> list[list[dict]]:
    """n conversations of TURNS greedy turns each, run together; every turn's prompt is the
    previous prompt, its output and a new user message (how the tracing client builds it)."""

    async def one(index: int) -> list[dict]:
        ids = template.encode_chat([{"role": "user", "content": f"Tell me a story, {index}."}])
        turns = []
        for turn in range(TURNS):
            body = {
                "input_ids": ids,
                "sampling_params": {"max_new_tokens": 12 + index, "temperature": 0.0},
                "return_logprob": True,
            }
            out = await engine.generate(body)
            turns.append({**out, "prompt_ids": ids})
            more = f"<|im_end|>\n<|im_start|>user\nAnd then ({turn})?<|im_end|>\n"
            ids = ids + out["output_ids"] + template.encode_piece(more + "<|im_start|>assistant\n")
        return turns

    return list(await asyncio.gather(*(one(i) for i in range(n))))


@pytest.mark.kernels  # outputs compared: run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)
async def test_a_later_turn_reuses_the_earlier_one_with_the_same_outputs(tiny_dir, template):
    assert EngineSettings().prefix_cache_tokens > 0  # on by default
    runs = {}
    for tokens in (0, 32768):
        async with LocalEngine(tiny_dir, prefix_cache_tokens=tokens) as engine:
            runs[tokens] = await conversations(engine, template, 4)
    first_turns_share = _common_length([c[0]["prompt_ids"] for c in runs[0]])
    for without, with_cache in zip(runs[0], runs[32768], strict=True):
        for turn, (a, b) in enumerate(zip(without, with_cache, strict=True)):
            assert a["output_ids"] == b["output_ids"]
            lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
            lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
            # fp32, cached KV against recomputed: other summation orders only; as in
            # tests/test_engine.py (15 matmuls, K <= 256, sum|W h| ~2.1): ~1.2e-4 first order,
            # 1e-3 leaves 8x (measured 4.8e-7, one ulp, both kernel sets); a cache entry from
            # the wrong prefix or position moves a log-prob by ~0.07 (median), 70x over it
            assert lp_b == pytest.approx(lp_a, abs=1e-3)
            assert a["meta_info"]["cached_tokens"] == 0
            if turn == 0:  # first turns prefilled together read their common start from one
                assert b["meta_info"]["cached_tokens"] in (0, first_turns_share)
            else:  # all of the previous turn but the token it sampled last
                previous = with_cache[turn - 1]["meta_info"]
                want = previous["prompt_tokens"] + previous["completion_tokens"] - 1
                assert b["meta_info"]["cached_tokens"] == want


def test_the_common_start_stops_short_of_the_shortest_prompts_last_token():
    assert _common_length([]) == 0
    assert _common_length([[1, 2, 3]]) == 2  # a row alone: all but its last token
    assert _common_length([[1, 2, 3, 4], [1, 2, 3, 4, 5]]) == 3  # the shorter one's last runs
    assert _common_length([[1, 2, 3, 4], [1, 2, 9, 4, 5], [1, 2, 3, 4]]) == 2
    assert _common_length([[7, 2], [8, 2]]) == 0
    assert _common_length([[5], [5]]) == 0


@pytest.mark.kernels  # outputs compared: run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)
async def test_a_burst_that_starts_alike_computes_its_common_start_once(tiny_dir, template):
    """A GRPO group's rows and few-shot prompts arrive together with the same first tokens: one
    prefill computes those once (every row but one reports them as cached_tokens), with the
    outputs the engine gives when each row computes its own."""
    system = {"role": "system", "content": "You answer in one short sentence. " * 3}
    questions = [f"What is {i} plus {i}?" for i in range(3)]
    prompts = [  # a group of four rows, then two other questions
        template.encode_chat([system, {"role": "user", "content": q}], add_generation_prompt=True)
        for q in [questions[0]] * 4 + questions[1:]
    ]
    shared = _common_length(prompts)
    assert shared >= SHARE_MIN_TOKENS and shared < min(len(p) for p in prompts) - 4
    runs = {}
    for tokens in (0, 4096):
        async with LocalEngine(tiny_dir, prefix_cache_tokens=tokens) as engine:
            # held while the burst arrives, so it is one prefill whatever the machine's speed
            await engine.pause_generation({"mode": "in_place"})
            body = {"sampling_params": {"max_new_tokens": 8, "temperature": 0.0}}
            burst = [
                asyncio.ensure_future(
                    engine.generate({**body, "input_ids": ids, "return_logprob": True})
                )
                for ids in prompts
            ]
            await engine.scheduler.wait_for(lambda: engine.scheduler.num_waiting == len(prompts))
            await engine.continue_generation()
            runs[tokens] = await asyncio.gather(*burst)
            if tokens:  # the common start stays cached for later arrivals
                later = await engine.generate({**body, "input_ids": prompts[-1][:-1] + [7]})
                assert later["meta_info"]["cached_tokens"] >= shared
    cached = sorted(out["meta_info"]["cached_tokens"] for out in runs[4096])
    assert cached == [0] + [shared] * (len(prompts) - 1)
    assert all(out["meta_info"]["cached_tokens"] == 0 for out in runs[0])
    for a, b in zip(runs[0], runs[4096], strict=True):
        assert a["output_ids"] == b["output_ids"]
        lp_a = [x[0] for x in a["meta_info"]["output_token_logprobs"]]
        lp_b = [x[0] for x in b["meta_info"]["output_token_logprobs"]]
        assert lp_b == pytest.approx(lp_a, abs=1e-3)  # the bound of the test above


async def test_changed_weights_and_flush_cache_empty_it(tiny_dir, template, tmp_path):
    nudged = tmp_path / "v1"
    shutil.copytree(tiny_dir, nudged)
    state = load_file(str(tiny_dir / "model.safetensors"))
    save_file({k: v + 0.05 for k, v in state.items()}, str(nudged / "model.safetensors"))
    async with LocalEngine(tiny_dir, prefix_cache_tokens=4096) as engine:
        cache = engine.scheduler.prefix_cache
        await conversations(engine, template, 2)
        assert len(cache) == 2 and 0 < cache.tokens <= 4096
        update = await engine.update_weights_from_disk({"model_path": str(nudged)})
        assert update["success"] and len(cache) == 0
        fresh = await conversations(engine, template, 1)
        assert fresh[0][0]["meta_info"]["cached_tokens"] == 0  # nothing of the old weights
        assert fresh[0][1]["meta_info"]["cached_tokens"] > 0
        assert engine.flush_cache() and len(cache) == 0


def _prefix_of(engine_model, ids: list[int]):
    from agentarium.inference.engine.prefix_cache import CachedPrefix

    _, cached = engine_model.prefill([ids], all_logits=False)
    keys = [k[0] for k in cached.keys]
    return CachedPrefix(keys=keys, values=[v[0] for v in cached.values], length=len(ids))


@pytest.mark.kernels  # outputs compared: run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)
def test_a_prefill_split_under_its_mask_bound_gives_the_same_logits_and_kv(tiny_dir):
    from agentarium.inference.engine.model import EngineModel

    model = EngineModel(tiny_dir)
    long, short = [i % 250 for i in range(900)], [(7 * i) % 250 for i in range(300)]
    prefixes = [_prefix_of(model, long[:500]), None]
    whole = model.prefill([long, short], all_logits=False, prefixes=prefixes)
    scored_whole = model.prefill([long[:700], short], all_logits=True)
    model.prefill_mask_bytes = 64 * 1024  # passes of at most a few dozen columns here
    assert len(model._chunks(2, 500, 400, masked=True)) >= 8
    split = model.prefill([long, short], all_logits=False, prefixes=prefixes)
    scored_split = model.prefill([long[:700], short], all_logits=True)
    # fp32, the same sums in other orders (attention a few dozen key columns at a time). First
    # order, each sum is off by ~sqrt(K) u times its sum of |terms| (u = 2**-24, Higham and
    # Mary's probabilistic bound): 15 matmuls of K <= 256 (16 u x ~2.1) and 4 attention sums
    # over up to 900 keys (30 u x <= 1.16, the largest |value|, softmax weights summing to
    # 1), two computations: 2 * (15 * 16 * 2.1 + 4 * 30 * 1.16) * 6e-8 = 7.7e-5 on a logit
    # (|logits| <= 1.0), less on layer 1's keys and values (|kv| <= 1.16), which have half the
    # path. 5e-4 leaves 6x (measured <= 5.4e-7, both kernel sets); a chunk that misses or
    # repeats key columns moves logits by ~0.07 (one token of context lost, median), 140x more.
    for (logits_a, kv_a), (logits_b, kv_b) in ((whole, split), (scored_whole, scored_split)):
        assert logits_a.shape == logits_b.shape
        assert torch.allclose(logits_a, logits_b, rtol=0, atol=5e-4)
        assert torch.equal(kv_a.mask, kv_b.mask)
        for a, b in zip(kv_a.keys + kv_a.values, kv_b.keys + kv_b.values, strict=True):
            assert torch.allclose(a, b, rtol=0, atol=5e-4)


PEAK_SCRIPT = """
import resource, sys
from pathlib import Path
from agentarium.inference.engine.model import EngineModel
from agentarium.inference.engine.prefix_cache import CachedPrefix
model = EngineModel(Path(sys.argv[1]))
ids = [i % 250 for i in range(24000)]
_, kv = model.prefill([ids[:12000]], all_logits=False)
prefix = CachedPrefix(keys=[k[0] for k in kv.keys], values=[v[0] for v in kv.values], length=12000)
del kv
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model.prefill([ids], all_logits=False, prefixes=[prefix])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_long_prompt_after_a_long_cached_prefix_stays_within_memory(tiny_dir, tmp_path):
    # Not a `kernels` test: the bound is on what the split pass allocates (its masks and
    # activations), which no kernel choice changes by hundreds of MB; under the avx2 tier it
    # took 99 s of a loaded run.
    # 12,000 new tokens after 12,000 cached ones: in one pass transformers builds a float mask
    # of 12,000 x 24,000 (1.1 GB; the process grew by 1,397 MB), and Claude Code's
    # 77,813-token call grew the engine to 23 GB before the kernel killed it. Split, the pass
    # grows the process by a few hundred MB.
    import json
    import subprocess
    import sys

    long_dir = tmp_path / "tiny-long"
    shutil.copytree(tiny_dir, long_dir)
    config = json.loads((long_dir / "config.json").read_text())
    config["max_position_embeddings"] = 32768
    (long_dir / "config.json").write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(long_dir)],
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    grown_mb = int(out.stdout.strip().splitlines()[-1])
    assert grown_mb < 600, f"the prefill grew the engine by {grown_mb} MB"
