"""``/generate`` with ``"stream": true`` on the local engine: SGLang's incremental chunks
(``--incremental-streaming-output``) over server-sent events, read by a real HTTP client from a
real engine on the tiny model; and the chunk assembly's text guarantee, fuzzed without a model."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from agentarium.formats import HeldText, IncrementalDecode
from agentarium.inference.engine import InvalidRequest, LocalEngine, start_server
from agentarium.inference.engine.request import GenerateRequest, SamplingParams
from agentarium.inference.engine.sampling import Draw
from agentarium.inference.engine.sequence import Sequence
from agentarium.inference.engine.stream import RequestStream
from agentarium.tiny import IM_END_ID, VOCAB_SIZE

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

PROMPT = [72, 101, 108, 108, 111, 44, 32, 49, 50, 43, 51, 52, 61]  # "Hello, 12+34="
LONG = 2048 - len(PROMPT) - 1  # as many tokens as the tiny model's context leaves


def seeded(n: int, seed: int = 7, **extra) -> dict:
    return {"max_new_tokens": n, "temperature": 1.0, "sampling_seed": seed, **extra}


@pytest.fixture
async def server(tiny_dir):
    engine = LocalEngine(tiny_dir, threads=1, max_batch=16, prefix_cache_tokens=4096)
    running = await start_server(engine, "127.0.0.1", 0)
    async with aiohttp.ClientSession(base_url=running.url) as http:
        yield engine, http
    await running.close()


async def events(resp: aiohttp.ClientResponse):
    """The ``data:`` payloads of a server-sent event stream, as they arrive."""
    async for line in resp.content:
        line = line.strip()
        if line:
            assert line.startswith(b"data: "), line
            yield line[len(b"data: ") :]


async def stream(http: aiohttp.ClientSession, body: dict) -> list[dict]:
    """Every chunk of a streamed request; checks the stream's framing and its end."""
    async with http.post("/generate", json={**body, "stream": True}) as resp:
        assert resp.status == 200 and resp.content_type == "text/event-stream"
        payloads = [p async for p in events(resp)]
    assert payloads[-1] == b"[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["finish_reason"] is not None
    return chunks


async def whole(http: aiohttp.ClientSession, body: dict) -> dict:
    async with http.post("/generate", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def assemble(chunks: list[dict]) -> dict:
    """The unstreamed response the chunks add up to."""
    meta = dict(chunks[-1]["meta_info"])
    for key in ("output_token_logprobs", "output_top_logprobs"):  # each chunk has its tokens'
        if key in meta:
            meta[key] = [t for c in chunks for t in c["meta_info"][key]]
    return {
        "text": "".join(c["text"] for c in chunks),
        "output_ids": [i for c in chunks for i in c["output_ids"]],
        "meta_info": meta,
    }


async def test_stream_adds_up_to_the_unstreamed_response(server):
    """Same seed, each request alone in the batch and the prefix cache emptied before each, so
    both run the same kernels on the same shapes: ids, log-probs (bit for bit) and text agree."""
    engine, http = server
    cases = [
        dict(sampling_params=seeded(48, ignore_eos=True), return_logprob=True),
        dict(sampling_params=seeded(200, seed=3), return_logprob=True),
        dict(sampling_params={"max_new_tokens": 0}, return_logprob=True),
        dict(
            sampling_params=seeded(24, seed=5, temperature=0.7, top_p=0.9),
            return_logprob=True,
            logprob_start_len=0,
            top_logprobs_num=3,
            return_text_in_logprobs=True,
        ),
    ]
    for extra in cases:
        body = {"input_ids": PROMPT, **extra}
        engine.flush_cache()
        want = await whole(http, body)
        engine.flush_cache()
        chunks = await stream(http, body)
        got = assemble(chunks)
        assert got["output_ids"] == want["output_ids"]
        assert got["text"] == want["text"]
        got_meta, want_meta = got["meta_info"], want["meta_info"]
        assert got_meta["output_token_logprobs"] == want_meta["output_token_logprobs"]
        for key in ("id", "e2e_latency"):
            got_meta.pop(key), want_meta.pop(key)
        assert got_meta == want_meta  # finish_reason, counts, version, top and prompt logprobs
        if "input_token_logprobs" in want_meta:  # every chunk carries the prompt's, as SGLang's
            for c in chunks:
                assert c["meta_info"]["input_token_logprobs"] == want_meta["input_token_logprobs"]
        counts = [c["meta_info"]["completion_tokens"] for c in chunks]
        assert counts == sorted(counts) and counts[-1] == len(want["output_ids"])
        assert all(len(c["output_ids"]) <= 1 for c in chunks)  # a chunk per step: one token


async def test_stream_text_with_stop_strings_and_stop_ids(server):
    """The texts add up to the unstreamed text when a stop string is cut from it (or kept,
    no_stop_trim), when a stop token is dropped from it, and with special tokens kept."""
    engine, http = server
    first = await whole(http, {"input_ids": PROMPT, "sampling_params": seeded(120)})
    ids = first["output_ids"]
    # a two-byte stop string taken from the output, printable ASCII, so it is in the text
    k = next(i for i in range(12, len(ids)) if all(32 < t < 127 for t in ids[i - 1 : i + 1]))
    stop = bytes(ids[k - 1 : k + 1]).decode()
    params = [
        seeded(120, stop=stop),
        seeded(120, stop=["never-seen", stop]),
        seeded(120, stop=stop, no_stop_trim=True),
        seeded(120, stop_token_ids=[ids[k]]),
        seeded(120, stop_token_ids=[ids[k]], skip_special_tokens=False),
        seeded(120, skip_special_tokens=False, ignore_eos=True),
    ]
    for p in params:
        body = {"input_ids": PROMPT, "sampling_params": p}
        want = await whole(http, body)
        got = assemble(await stream(http, body))
        assert got["output_ids"] == want["output_ids"], p
        assert got["text"] == want["text"], p
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"], p
    stopped = await whole(http, {"input_ids": PROMPT, "sampling_params": seeded(120, stop=stop)})
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


async def test_chunks_arrive_while_generating(server):
    _, http = server
    body = {"input_ids": PROMPT, "sampling_params": seeded(64, ignore_eos=True), "stream": True}
    async with http.post("/generate", json=body) as resp:
        first = json.loads(await anext(events(resp)))
        rest = [p async for p in events(resp)]
    assert first["meta_info"]["completion_tokens"] < 64  # it came before the last token
    assert first["meta_info"]["finish_reason"] is None
    assert len(rest) - 1 > 1  # more chunks before the last, then [DONE]
    last = json.loads(rest[-2])
    assert last["meta_info"]["completion_tokens"] == 64
    assert set(last["meta_info"]) >= {"e2e_latency", "weight_version", "cached_tokens"}


async def test_a_client_that_disconnects_frees_its_row(server):
    """Closing the connection after the first chunk: the row leaves the batch within a step
    (far fewer tokens than asked), nothing of it is kept in the prefix cache, and the engine
    serves the next request."""
    engine, http = server
    s = engine.scheduler
    engine.flush_cache()
    before = s.tokens_generated
    body = {"input_ids": PROMPT, "sampling_params": seeded(LONG, ignore_eos=True), "stream": True}
    resp = await http.post("/generate", json=body)
    await anext(events(resp))
    resp.close()  # drops the connection
    await asyncio.wait_for(s.wait_for(lambda: s.num_running == 0 and s.num_waiting == 0), 1.0)
    # measured: 2 (the first chunk's token, then the step whose chunk found the client gone);
    # the close reaches the server within a loop iteration or two and every step takes one,
    # so a slower machine adds few
    assert s.tokens_generated - before < 10
    assert s.prefix_cache.tokens == 0
    chunks = await stream(http, {"input_ids": PROMPT, "sampling_params": seeded(8)})
    assert chunks[-1]["meta_info"]["completion_tokens"] >= 1


async def test_in_process_stream_closed_early_frees_its_row(server):
    engine, _ = server
    s = engine.scheduler
    body = {"input_ids": PROMPT, "sampling_params": seeded(LONG, ignore_eos=True)}
    chunks = engine.generate_stream(body)
    first = await anext(chunks)
    assert first["meta_info"]["completion_tokens"] >= 1
    await chunks.aclose()
    await asyncio.wait_for(s.wait_for(lambda: s.num_running == 0), 1.0)
    whole_out = await engine.generate({"input_ids": PROMPT, "sampling_params": seeded(4)})
    assert len(whole_out["output_ids"]) == 4


async def test_abort_request_ends_the_stream(server):
    _, http = server
    body = {
        "input_ids": PROMPT,
        "sampling_params": seeded(LONG, ignore_eos=True),
        "stream": True,
        "rid": "streamed-1",
        "return_logprob": True,
    }
    async with http.post("/generate", json=body) as resp:
        payloads = events(resp)
        await anext(payloads)
        async with http.post("/abort_request", json={"rid": "streamed-1"}) as aborted:
            assert aborted.status == 200
        rest = [p async for p in payloads]
    assert rest[-1] == b"[DONE]"
    last = json.loads(rest[-2])["meta_info"]
    assert last["id"] == "streamed-1"
    assert last["finish_reason"]["type"] == "abort"
    assert "message" in last["finish_reason"]
    assert 0 < last["completion_tokens"] < LONG


async def test_a_version_change_mid_stream_shows_in_chunks_and_the_last(server):
    _, http = server
    body = {
        "input_ids": PROMPT,
        "sampling_params": seeded(LONG, ignore_eos=True),
        "stream": True,
        "rid": "streamed-2",
    }
    async with http.post("/generate", json=body) as resp:
        payloads = events(resp)
        first = json.loads(await anext(payloads))["meta_info"]
        assert first["weight_version"] == "default"
        change = {"new_version": "5", "abort_all_requests": False}
        async with http.post("/update_weight_version", json=change) as changed:
            assert changed.status == 200
        async for payload in payloads:  # to the first chunk whose token is of version 5
            meta = json.loads(payload)["meta_info"]
            if meta["weight_version"] == "5":
                break
        split = meta["completion_tokens"] - 1  # a token a chunk: this one is the first of 5
        async with http.post("/abort_request", json={"rid": "streamed-2"}) as aborted:
            assert aborted.status == 200
        rest = [p async for p in payloads]
    last = json.loads(rest[-2])["meta_info"]
    assert last["finish_reason"]["type"] == "abort" and last["weight_version"] == "5"
    assert last["weight_versions"] == [
        {"version": "default", "start": 0, "end": split},
        {"version": "5", "start": split, "end": last["completion_tokens"]},
    ]


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"input_ids": [], "sampling_params": {}}, "empty"),
        ({"input_ids": PROMPT, "stream": "yes"}, "stream must be true or false"),
    ],
)
async def test_a_bad_streamed_request_answers_400(server, body, fragment):
    _, http = server
    async with http.post("/generate", json={"stream": True, **body}) as resp:
        assert resp.status == 400 and resp.content_type == "application/json"
        out = await resp.json()
    assert set(out) == {"error"} and fragment in out["error"]["message"]


async def test_generate_refuses_stream_true_in_process(server):
    engine, _ = server
    with pytest.raises(InvalidRequest, match="generate_stream"):
        await engine.generate({"input_ids": PROMPT, "stream": True})
    with pytest.raises(InvalidRequest, match="max_new_tokens"):
        engine.generate_stream({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": -1}})


# ---- the text guarantee, without a model ------------------------------------------------------


def test_windows_stay_short_and_add_up_on_multibyte_text(tiny_dir):
    """One token per byte (the tiny tokenizer): every character past ASCII spans tokens. Each
    step decodes at most two characters' tokens, and the deltas are the whole decode."""
    tok = Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
    text = "héllo wörld, 中文 and 🎉🎉 ok ∑x ≤ 3"
    ids = list(text.encode())
    widths: list[int] = []

    def decode(window: list[int]) -> str:
        widths.append(len(window))
        return tok.decode(window)

    decoded, held = IncrementalDecode(decode), HeldText()
    deltas = [held.release(decoded.add([token])) for token in ids]
    assert "".join(deltas) == text
    assert max(widths) <= 8  # two 4-byte characters at most
    assert all("\ufffd" not in d for d in deltas)  # no half character ever went out


def _trained(kind: str) -> Tokenizer:
    """A BPE trained here: byte-level, whose merges cut through multi-byte characters (as
    SmolLM2's do), or sentencepiece-style (Metaspace), whose decoder drops the first token's
    leading space (so a window decoded alone would lose it)."""
    tok = Tokenizer(models.BPE())
    if kind == "byte-bpe":
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace()
        tok.decoder = decoders.Metaspace()
        alphabet = []
    corpus = ["中文字符和汉字 ünïcödé façade 🎉🎊 ∑∫≤≥ naïve café, hello world"] * 50
    trainer = trainers.BpeTrainer(
        vocab_size=400, initial_alphabet=alphabet, special_tokens=["<|end|>"]
    )
    tok.train_from_iterator(corpus, trainer)
    return tok


@pytest.mark.parametrize("tokenizer", ["tiny", "byte-bpe", "metaspace"])
async def test_chunks_add_up_under_random_tokens_and_stops(tiny_dir, tokenizer):
    """Random ids (multi-byte characters split anywhere, invalid bytes, special tokens), stop
    strings with shared prefixes, stop ids, any step and consumer pacing: the chunks' texts
    always add up to the unstreamed text, their ids and log-probs to the whole output."""
    tok = (
        Tokenizer.from_file(str(tiny_dir / "tokenizer.json"))
        if tokenizer == "tiny"
        else _trained(tokenizer)
    )
    vocab = VOCAB_SIZE if tokenizer == "tiny" else tok.get_vocab_size()
    rng = random.Random(0)
    for case in range(300):
        ids = [rng.randrange(vocab) for _ in range(rng.randrange(1, 60))]
        text = tok.decode(ids)
        stops: tuple[str, ...] = ()
        if text and rng.random() < 0.6:  # stop strings from the text itself, so they match
            at = rng.randrange(len(text))
            stop = text[at : at + rng.randrange(1, 4)]
            stops = (stop, stop[:1] + "never") if "\ufffd" not in stop else ()
        params = SamplingParams(
            max_new_tokens=len(ids) + rng.randrange(0, 2),
            stop=stops,
            stop_token_ids=frozenset([ids[-1]] if rng.random() < 0.2 else []),
            ignore_eos=rng.random() < 0.5,
            skip_special_tokens=rng.random() < 0.7,
            no_stop_trim=rng.random() < 0.2,
        )
        seq, chunks = await _replay(tok, ids, params, rng)
        want = seq.response("v")
        got = assemble(chunks)
        where = (case, ids, params)
        assert got["text"] == want["text"], where
        assert got["output_ids"] == want["output_ids"], where
        assert (
            got["meta_info"]["output_token_logprobs"] == want["meta_info"]["output_token_logprobs"]
        )
        assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


async def _replay(tok: Tokenizer, ids: list[int], params: SamplingParams, rng: random.Random):
    """Feed `ids` to a Sequence as the scheduler would, a few tokens a step (on_step after
    each), the consumer reading at its own pace; abort if the ids run out unfinished."""
    loop = asyncio.get_running_loop()
    request = GenerateRequest(rid="r", input_ids=(1,), sampling=params, return_logprob=True)
    seq = Sequence(
        request,
        tokenizer=tok,
        eos_token_ids=frozenset({IM_END_ID}),
        generator=torch.Generator(),
        future=loop.create_future(),
    )
    stream = RequestStream(seq)
    chunks: list[dict] = []

    async def consume() -> None:
        async for chunk in stream.chunks():
            chunks.append(chunk)
            if rng.random() < 0.3:
                await asyncio.sleep(0)

    consumer = asyncio.create_task(consume())
    feed = iter(ids)
    while not seq.finished:
        step = [t for _, t in zip(range(rng.randrange(1, 4)), feed, strict=False)]
        if not step:
            seq.abort("ran out")
            break
        for token in step:
            if not seq.finished:
                seq.append(Draw(token, -float(token), None), "v")
        seq.on_step()
        if rng.random() < 0.5:
            await asyncio.sleep(0)
    seq.future.set_result(seq.response("v"))
    await consumer
    return seq, chunks
