"""The local engine against SGLang's HTTP contract (SGLANG_API.md), on the tiny model."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import aiohttp
import pytest
import torch
from safetensors.torch import load_file, save_file

from agentarium.formats.chat_template import ChatTemplate
from agentarium.inference.engine import LocalEngine, start_server
from agentarium.tiny import ensure_tiny_model

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

PROMPT = [72, 101, 108, 108, 111, 44, 32, 49, 50, 43, 51, 52, 61]  # "Hello, 12+34="
META_KEYS = {
    "id",
    "finish_reason",
    "prompt_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_version",
    "e2e_latency",
}


def greedy(n: int, **extra) -> dict:
    return {"max_new_tokens": n, "temperature": 0.0, **extra}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return ensure_tiny_model(tmp_path_factory.mktemp("home"))


@pytest.fixture(scope="module")
def perturbed(tiny, tmp_path_factory) -> Path:
    """A copy of the tiny model with every weight nudged: another policy version."""
    out = tmp_path_factory.mktemp("v1")
    for file in tiny.iterdir():
        shutil.copy(file, out / file.name)
    gen = torch.Generator().manual_seed(1)
    state = load_file(str(tiny / "model.safetensors"))
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture
async def server(tiny):
    engine = LocalEngine(tiny, threads=1, max_batch=16)
    running = await start_server(engine, "127.0.0.1", 0)
    async with aiohttp.ClientSession(base_url=running.url) as http:
        yield engine, http
    await running.close()


async def post(http: aiohttp.ClientSession, path: str, body: dict | None = None):
    async with http.post(path, json=body if body is not None else {}) as resp:
        if resp.content_type == "application/json":
            return resp.status, await resp.json()
        return resp.status, await resp.text()


async def generate(http, **body) -> dict:
    status, out = await post(http, "/generate", body)
    assert status == 200, out
    return out


def reference_logprobs(tiny: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]  # (T, V)
    return torch.log_softmax(logits.float(), dim=-1)


async def test_generate_response_shape(server):
    """Seeded (``sampling_seed`` 7): the same 12 tokens every run on one CPU. On other kernels
    the probabilities move by rounding (~1e-7) and a draw changes only if the seeded uniform
    falls that close to a boundary of the cumulative distribution (the sampler inverts it at
    one uniform a token): ~12 x 2e-7 a run, and then EOS (1/263) must be drawn early for the
    length to differ."""
    _, http = server
    out = await generate(
        http,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 7},
        return_logprob=True,
        logprob_start_len=-1,
        rid="job-1-call-0",
    )
    assert set(out) == {"text", "output_ids", "meta_info"}
    meta = out["meta_info"]
    assert set(meta) == META_KEYS | {"output_token_logprobs"}
    assert meta["id"] == "job-1-call-0"
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == len(PROMPT)
    assert meta["completion_tokens"] == len(out["output_ids"]) == 12
    assert meta["cached_tokens"] == 0 and meta["weight_version"] == "default"
    logprobs = meta["output_token_logprobs"]
    assert len(logprobs) == len(out["output_ids"])
    for (lp, tid, text), out_id in zip(logprobs, out["output_ids"], strict=True):
        assert isinstance(lp, float) and lp <= 0 and tid == out_id and text is None
    assert isinstance(out["text"], str)


async def test_text_prompt_and_no_logprobs(server):
    _, http = server
    out = await generate(http, text="12+34=", sampling_params=greedy(3))
    assert out["meta_info"]["prompt_tokens"] == 6
    assert "output_token_logprobs" not in out["meta_info"]
    assert set(out["meta_info"]) == META_KEYS


async def test_logprobs_match_transformers_at_temperature_1(server, tiny):
    _, http = server
    out = await generate(
        http,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 3},
        return_logprob=True,
        logprob_start_len=0,
    )
    ids = PROMPT + out["output_ids"]
    ref = reference_logprobs(tiny, ids)
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    want = torch.stack([ref[len(PROMPT) - 1 + i, t] for i, t in enumerate(out["output_ids"])])
    # Both fp32 (the engine serves fp32 only): the same products summed in other orders (a KV
    # cache and one row against the whole sequence). Per computation, each of the 15 matmuls
    # on the path (width K <= 256) is off by ~sqrt(K) * u * sum|w x| (u = 2**-24; the
    # probabilistic bound of Higham and Mary; sum|W h| <= 2.1 at the head on these ids), first
    # order 15 * 16 * 6e-8 * 2.1 = 3e-5, doubled by log-softmax (z_t - logsumexp z) and by
    # there being two computations: 1.2e-4. The tolerance, 1e-3, is 8x that (measured: 4.8e-7,
    # one ulp at |lp| ~ 6, on both kernel sets); what it guards, the cache or a position (one
    # token of context lost moves these log-probs by 0.068, median), moves them 60x more.
    assert torch.allclose(got, want, rtol=0, atol=1e-3), (got - want).abs().max()
    prompt_lps = out["meta_info"]["input_token_logprobs"]
    assert prompt_lps[0] == [None, PROMPT[0], None] and len(prompt_lps) == len(PROMPT)
    want_prompt = [float(ref[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]
    assert [lp for lp, _, _ in prompt_lps[1:]] == pytest.approx(want_prompt, abs=1e-3)  # as above


async def test_long_replies_in_a_changing_batch_keep_exact_logprobs(server, tiny):
    """Rows of 10 to 200 new tokens, started together and apart: the batch's KV cache grows
    in place 64 columns at a time (kv.ROOM) and is rebuilt as rows leave and join; every reply's
    log-probs still equal transformers' over the whole sequence (the bound of the test above,
    whose derivation does not depend on the length: attention's sums over <= 213 positions add
    sqrt(213) u at most to a matmul's sqrt(256) u)."""
    engine, http = server
    ignore = {"temperature": 1.0, "ignore_eos": True}
    first = [
        generate(
            http,
            input_ids=PROMPT[: 5 + i],
            sampling_params={"max_new_tokens": n, "sampling_seed": i, **ignore},
            return_logprob=True,
        )
        for i, n in enumerate((200, 10, 70, 130))
    ]
    started = [asyncio.ensure_future(call) for call in first]
    await engine.scheduler.wait_for(lambda: engine.scheduler.tokens_generated >= 4 * 80)
    later = await generate(
        http,
        input_ids=PROMPT,
        sampling_params={"max_new_tokens": 90, "sampling_seed": 9, **ignore},
        return_logprob=True,
    )
    outs = [*await asyncio.gather(*started), later]
    prompts = [PROMPT[: 5 + i] for i in range(4)] + [PROMPT]
    for prompt, out, n in zip(prompts, outs, (200, 10, 70, 130, 90), strict=True):
        assert len(out["output_ids"]) == n
        ref = reference_logprobs(tiny, prompt + out["output_ids"])
        got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
        want = torch.stack([ref[len(prompt) - 1 + i, t] for i, t in enumerate(out["output_ids"])])
        assert torch.allclose(got, want, rtol=0, atol=1e-3), (got - want).abs().max()


async def test_outputs_do_not_depend_on_the_batch(server):
    """Deterministic: greedy and seeded draws (``sampling_seed`` 11, one generator a request).
    Batched and alone, the logits differ by rounding only (~1e-6; log-probs against
    transformers differ by 4.8e-7 above); the greedy paths' closest top-two gap is 5.2e-4
    (median 0.056, over their 160 steps), so no kernel set can flip one by 500x. A seeded
    draw flips only when its uniform falls within that rounding of a boundary of the
    cumulative distribution: ~160 x 2e-6 = 3e-4 on a new kernel set, once, not a rate."""
    engine, http = server
    prompts = [PROMPT[: 3 + i] + [40 + i] * i for i in range(8)]
    seeded = {"max_new_tokens": 20, "temperature": 0.8, "top_p": 0.9, "sampling_seed": 11}
    alone = [await generate(http, input_ids=p, sampling_params=greedy(20)) for p in prompts]
    alone_seeded = [await generate(http, input_ids=p, sampling_params=seeded) for p in prompts]
    steps_before = engine.scheduler.steps
    bodies = [dict(input_ids=p, sampling_params=greedy(20)) for p in prompts]
    bodies += [dict(input_ids=p, sampling_params=seeded) for p in prompts]
    together = await asyncio.gather(*(generate(http, **b) for b in bodies))
    assert engine.scheduler.steps - steps_before < 8 * 20  # they really shared forward passes
    for a, b in zip(alone + alone_seeded, together, strict=True):
        assert a["output_ids"] == b["output_ids"]


async def test_stop_token_ids(server):
    _, http = server
    first = (await generate(http, input_ids=PROMPT, sampling_params=greedy(16)))["output_ids"]
    stop = first[5]
    cut = first.index(stop)
    out = await generate(http, input_ids=PROMPT, sampling_params=greedy(16, stop_token_ids=[stop]))
    assert out["output_ids"] == first[: cut + 1]  # the matched token is kept
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    ignored = await generate(
        http, input_ids=PROMPT, sampling_params=greedy(16, stop_token_ids=[stop], ignore_eos=True)
    )
    assert ignored["output_ids"] == first


async def test_stop_strings(server, tiny):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tiny / "tokenizer.json"))
    _, http = server
    prompt = list(b"Count: 1, 2, 3, ")
    first = (await generate(http, input_ids=prompt, sampling_params=greedy(40)))["output_ids"]
    # a stop string made of two consecutive output bytes that decode to printable ASCII
    k = next(i for i in range(2, 40) if all(32 < t < 127 for t in first[i - 1 : i + 1]))
    stop = bytes(first[k - 1 : k + 1]).decode()
    end = next(i for i in range(40) if stop in tok.decode(first[: i + 1]))
    for stop_param in (stop, [stop, "never-seen"]):
        out = await generate(http, input_ids=prompt, sampling_params=greedy(40, stop=stop_param))
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        assert out["output_ids"] == first[: end + 1]
        full = tok.decode(first[: end + 1])
        assert out["text"] == full[: full.find(stop)]
    kept = await generate(
        http, input_ids=prompt, sampling_params=greedy(40, stop=stop, no_stop_trim=True)
    )
    assert kept["text"].endswith(stop)


async def test_max_new_tokens_length_and_zero(server):
    _, http = server
    out = await generate(http, input_ids=PROMPT, sampling_params=greedy(5, ignore_eos=True))
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 5}
    assert len(out["output_ids"]) == 5
    zero = await generate(http, input_ids=PROMPT, sampling_params=greedy(0), return_logprob=True)
    assert zero["output_ids"] == [] and zero["text"] == ""
    assert zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert zero["meta_info"]["output_token_logprobs"] == []


async def test_update_weights_from_disk(server, tiny, perturbed, tmp_path):
    _, http = server
    body = dict(input_ids=PROMPT, sampling_params=greedy(16), return_logprob=True)
    before = await generate(http, **body)
    status, out = await post(
        http,
        "/update_weights_from_disk",
        {"model_path": str(perturbed), "weight_version": "7", "flush_cache": True},
    )
    assert status == 200 and out["success"] is True and out["num_paused_requests"] == 0
    assert "7" in out["message"]
    after = await generate(http, **body)
    assert after["meta_info"]["weight_version"] == "7"
    assert (
        after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    )
    async with http.get("/model_info") as resp:
        info = await resp.json()
    assert info["weight_version"] == "7" and info["is_generation"] is True
    assert set(info) >= {"model_path", "tokenizer_path", "is_generation", "weight_version"}

    # another architecture: refused, the served weights stay
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    status, out = await post(http, "/update_weights_from_disk", {"model_path": str(other)})
    assert status == 400 and out["success"] is False and "Llama" in out["message"]
    status, out = await post(http, "/update_weights_from_disk", {"model_path": str(tiny)})
    assert status == 200 and out["success"] is True
    restored = await generate(http, **body)
    assert restored["output_ids"] == before["output_ids"]
    assert restored["meta_info"]["weight_version"] == "7"  # no version given: unchanged


async def test_update_without_pause_waits_for_in_flight(server, perturbed):
    engine, http = server
    body = dict(input_ids=PROMPT, sampling_params=greedy(200, ignore_eos=True))
    reference = await generate(http, **body)
    in_flight = asyncio.create_task(generate(http, **body))
    await engine.scheduler.wait_for(lambda: engine.scheduler.num_running == 1)
    status, out = await post(
        http, "/update_weights_from_disk", {"model_path": str(perturbed), "weight_version": "2"}
    )
    assert status == 200 and out["success"]
    done = await in_flight
    # finished, not aborted, entirely on the old weights
    assert done["output_ids"] == reference["output_ids"]
    assert done["meta_info"]["finish_reason"] == {"type": "length", "length": 200}
    assert done["meta_info"]["weight_version"] == "default"
    assert "weight_versions" not in done["meta_info"]
    after = await generate(http, **body)
    assert after["meta_info"]["weight_version"] == "2"


async def test_pause_abort_finishes_in_flight_with_abort(server):
    engine, http = server
    body = dict(
        input_ids=PROMPT, sampling_params=greedy(1500, ignore_eos=True), return_logprob=True
    )
    running = asyncio.create_task(generate(http, **body))
    await engine.scheduler.wait_for(lambda: engine.scheduler.tokens_generated >= 3)
    status, out = await post(http, "/pause_generation", {"mode": "abort"})
    assert status == 200 and out["status"] == "ok"
    aborted = await running
    meta = aborted["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and "message" in meta["finish_reason"]
    assert 0 < meta["completion_tokens"] < 1500
    assert len(meta["output_token_logprobs"]) == len(aborted["output_ids"])

    # while paused, new requests wait for continue_generation
    waiting = asyncio.create_task(generate(http, input_ids=PROMPT, sampling_params=greedy(2)))
    await engine.scheduler.wait_for(lambda: engine.scheduler.num_waiting == 1)
    assert not waiting.done()
    status, _ = await post(http, "/continue_generation")
    assert status == 200
    assert (await waiting)["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.parametrize("mode", ["in_place", "retract"])
async def test_pause_keeps_requests_and_resumes(server, mode):
    engine, http = server
    body = dict(input_ids=PROMPT, sampling_params=greedy(300, ignore_eos=True))
    reference = await generate(http, **body)
    running = asyncio.create_task(generate(http, **body))
    await engine.scheduler.wait_for(lambda: engine.scheduler.num_running == 1)
    await post(http, "/pause_generation", {"mode": mode})
    tokens = engine.scheduler.tokens_generated
    status, _ = await post(http, "/flush_cache")
    # in place, the paused request keeps its cache; retracted, it has none until continue
    assert status == (400 if mode == "in_place" else 200)
    assert not running.done() and engine.scheduler.tokens_generated == tokens
    await post(http, "/continue_generation")
    resumed = await running
    assert resumed["output_ids"] == reference["output_ids"]
    assert resumed["meta_info"]["finish_reason"] == {"type": "length", "length": 300}


async def test_update_while_paused_in_place_records_version_spans(server, perturbed):
    engine, http = server
    running = asyncio.create_task(
        generate(http, input_ids=PROMPT, sampling_params=greedy(300, ignore_eos=True))
    )
    await engine.scheduler.wait_for(lambda: engine.scheduler.tokens_generated >= 5)
    await post(http, "/pause_generation", {"mode": "in_place"})
    split = engine.scheduler.tokens_generated
    status, out = await post(
        http, "/update_weights_from_disk", {"model_path": str(perturbed), "weight_version": "3"}
    )
    assert status == 200 and out["num_paused_requests"] == 1
    await post(http, "/continue_generation")
    meta = (await running)["meta_info"]
    assert meta["weight_version"] == "3"
    assert meta["weight_versions"] == [
        {"version": "default", "start": 0, "end": split},
        {"version": "3", "start": split, "end": 300},
    ]


async def test_update_weight_version(server):
    _, http = server
    status, out = await post(http, "/update_weight_version", {"new_version": "12"})
    assert status == 200 and out == {
        "success": True,
        "message": "Weight version updated to 12",
        "new_version": "12",
    }
    out = await generate(http, input_ids=PROMPT, sampling_params=greedy(1))
    assert out["meta_info"]["weight_version"] == "12"


async def test_health_info_and_flush(server, tiny):
    _, http = server
    for path in ("/health", "/health_generate"):
        async with http.get(path) as resp:
            assert resp.status == 200, path
    for path in ("/model_info", "/get_model_info"):
        async with http.get(path) as resp:
            info = await resp.json()
        assert info["model_path"] == str(tiny) and info["tokenizer_path"] == str(tiny)
        assert info["is_generation"] is True and info["weight_version"] == "default"
        # not SGLang's: what a consumer compares before cross-sampling with this engine
        assert info["tokenizer_fingerprint"] == ChatTemplate.from_model_dir(tiny).fingerprint
    for method in (http.get, http.post):
        async with method("/flush_cache") as resp:
            assert resp.status == 200


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input_ids": []}, "empty"),
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [1] * 2048}, "context length"),
        ({"input_ids": [1] * 2000, "sampling_params": {"max_new_tokens": 100}}, "exceeds"),
        ({"input_ids": PROMPT, "text": "hi"}, "exactly one"),
        ({"input_ids": [1, 100000]}, "token ids"),
        ({"input_ids": [[1, 2], [3]]}, "one prompt"),
        ({"input_ids": PROMPT, "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": PROMPT, "sampling_params": {"top_p": 0}}, "top_p"),
        ({"input_ids": PROMPT, "sampling_params": {"n": 2}}, "not supported"),
        ({"input_ids": PROMPT, "sampling_params": {"max_tokens": 2}}, "unknown"),
        ({"input_ids": PROMPT, "stream": "yes"}, "stream must be true or false"),
        ({"input_ids": PROMPT, "bogus": 1}, "unknown"),
    ],
)
async def test_bad_requests_answer_400(server, body, fragment):
    _, http = server
    status, out = await post(http, "/generate", body)
    assert status == 400
    assert set(out) == {"error"} and fragment in out["error"]["message"]


async def test_bad_json_and_bad_control_bodies(server):
    _, http = server
    async with http.post("/generate", data=b"{not json") as resp:
        assert resp.status == 400
        assert "JSON" in (await resp.json())["error"]["message"]
    status, out = await post(http, "/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode" in out["error"]["message"]
    status, out = await post(http, "/update_weights_from_disk", {})
    assert status == 400 and "model_path" in out["error"]["message"]


async def test_in_process_engine(tiny):
    async with LocalEngine(tiny) as engine:
        out = await engine.generate({"input_ids": PROMPT, "sampling_params": greedy(4)})
        assert len(out["output_ids"]) == 4
        assert "steps=" in repr(engine)
