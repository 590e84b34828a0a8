"""Weights updated in the middle of a generation: the call records every version its tokens came
from (``LLMCall.weight_spans``), and the trainer judges each token by its own version.

The update is the syncer's sequence (pause in place, update from disk with the new identity as
``weight_version``, continue) while a long ``/generate`` runs, on the real local engine and on
the SGLang stand-in; no request may be aborted by it."""

from __future__ import annotations

import asyncio
import shutil
from collections import Counter
from pathlib import Path

import aiohttp
import pytest
import torch
from fake_sglang import FakeSGLang
from safetensors.torch import load_file, save_file
from trainlib import served

from agentarium.consumers.backends import SGLangBackend
from agentarium.consumers.backends.sglang import weight_spans
from agentarium.consumers.tracing.llm import TracingLLM
from agentarium.inference.engine import LocalEngine, start_server
from agentarium.schemas import (
    LLMCall,
    Sampling,
    SchemaError,
    Trajectory,
    decode,
    encode,
    encode_json,
    loads,
)
from agentarium.trainer.batch import build_rows
from agentarium.trainer.groups import BUFFERED, GroupBuffer, Selection

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

RUN = "spans"
V1 = served(RUN, 1)  # what the syncer names version 1 of the run
QUESTION = [{"role": "user", "content": "Count to a thousand."}]
LONG = 300  # tokens: the update lands well inside the generation


@pytest.fixture(scope="module")
def perturbed(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model with every weight nudged: version 1 of the run."""
    out = tmp_path_factory.mktemp("v1")
    for file in tiny_dir.iterdir():
        if file.is_file():
            shutil.copy(file, out / file.name)
    gen = torch.Generator().manual_seed(1)
    state = load_file(str(tiny_dir / "model.safetensors"))
    state = {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state.items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


async def post(url: str, path: str, body: dict) -> dict:
    async with aiohttp.ClientSession() as http, http.post(url + path, json=body) as resp:
        out = await resp.json()
        assert resp.status == 200, out
        return out


async def update_in_place(url: str, model_path: Path, version: str) -> dict:
    """The syncer's reload: pause in place, update from disk, continue."""
    await post(url, "/pause_generation", {"mode": "in_place"})
    try:
        return await post(
            url,
            "/update_weights_from_disk",
            {
                "model_path": str(model_path),
                "load_format": None,
                "weight_version": version,
                "flush_cache": True,
                "abort_all_requests": False,
            },
        )
    finally:
        await post(url, "/continue_generation", {})


def llm(url: str, template, max_new_tokens: int) -> TracingLLM:
    sampling = Sampling(temperature=1.0, max_new_tokens=max_new_tokens)
    return TracingLLM(
        SGLangBackend([url], backoff=0.0), template, job_sampling=sampling, model_name="tiny"
    )


def trained_staleness(call: LLMCall, *, version: int, max_staleness: int):
    """The trainer's view of ``call`` beside a fresh sibling, at ``version`` with TIS: the
    group's tokens by staleness, and the TIS flags of the call's response tokens."""
    buffer = GroupBuffer(group_timeout_s=600, run=RUN)
    fresh = LLMCall(
        prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-1.0, -1.0],
        finish_reason="stop", weight_version=served(RUN, version),
    )  # fmt: skip
    for job, reward, calls in (("spanned", 1.0, [call]), ("fresh", 0.0, [fresh])):
        trajectory = Trajectory(
            job_id=job, agent="a", task_id="t", group_id="g", group_size=2, run=RUN,
            status="ok", reward=reward, calls=calls,
        )  # fmt: skip
        assert buffer.add(trajectory, None, now=0.0) == BUFFERED
    selection = Selection(version=version, max_staleness=max_staleness, stale_policy="tis")
    (group,), _ = buffer.select(1, selection)
    rows, _ = build_rows(group.samples)
    (row,) = [r for r in rows if r.job_id == "spanned"]
    return group.token_staleness - Counter({0: 2}), row.tis[len(call.prompt_ids) :]


async def test_an_update_mid_generation_on_the_local_engine(tiny_dir, template, perturbed):
    # No prefix cache: both generations below prefill the prompt alike, one request at a time,
    # so the same seed draws the same tokens with bitwise the same log-probs on the same weights.
    engine = LocalEngine(tiny_dir, threads=1, max_batch=4, prefix_cache_tokens=0)
    running = await start_server(engine, "127.0.0.1", 0)
    scheduler = engine.scheduler
    seeded = {"ignore_eos": True, "sampling_seed": 7}
    reference, client = llm(running.url, template, LONG), llm(running.url, template, LONG)
    try:
        await reference.chat(QUESTION, **seeded)
        first = scheduler.tokens_generated
        generating = asyncio.create_task(client.chat(QUESTION, **seeded))
        await scheduler.wait_for(lambda: scheduler.tokens_generated >= first + 5)
        out = await update_in_place(running.url, perturbed, V1)
        await generating
    finally:
        for one in (reference, client):
            await one.backend.aclose()
        await running.close()
    (before,) = reference.calls
    assert out["success"] and out["num_paused_requests"] == 1  # updated around it, not aborted
    (call,) = client.calls
    assert call.finish_reason == "length" and len(call.response_ids) == LONG
    (base, start), (version, split) = call.weight_spans
    assert (base, start, version) == ("default", 0, V1) and 0 < split < LONG
    assert call.weight_version == V1  # the last token's
    # the spans are true: the tokens before the update are the base weights' (the same seed
    # draws the same tokens), and the first one after it has the new weights' log-prob
    assert call.response_ids[:split] == before.response_ids[:split]
    assert call.response_logprobs[:split] == before.response_logprobs[:split]
    assert call.response_logprobs[split] != before.response_logprobs[split]
    # the spans survive the wire, msgpack and JSON
    stored = Trajectory(
        job_id="j", agent="a", task_id="t", group_id="g", status="ok", reward=1.0, calls=[call]
    )
    for wire in (encode(stored), encode_json(stored)):
        assert decode(Trajectory, wire).calls[0].weight_spans == call.weight_spans

    # the trainer, at version 2 with max staleness 1: the base's tokens are 2 behind (too
    # stale: importance-weighted), version 1's are 1 behind (trained as they are)
    tokens, tis = trained_staleness(call, version=2, max_staleness=1)
    assert tokens == {2: split, 1: LONG - split}
    assert tis == [1] * split + [0] * (LONG - split)


async def test_an_update_mid_generation_on_the_sglang_stand_in(template, tmp_path, span_exporter):
    output = list(range(60, 70))
    fake = FakeSGLang(output_ids=output, text="counting")
    fake.gate = asyncio.Event()  # the request holds here, its first half generated
    weights = tmp_path / "v1"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")
    await fake.start()
    client = llm(fake.url, template, 64)
    try:
        generating = asyncio.create_task(client.chat(QUESTION))
        await fake.wait_for_requests(1)
        out = await update_in_place(fake.url, weights, V1)
        fake.gate.set()
        await generating
    finally:
        await client.backend.aclose()
        await fake.close()
    assert out["success"]
    assert [path for path, _ in fake.control] == [
        "/pause_generation",
        "/update_weights_from_disk",
        "/continue_generation",
    ]
    (call,) = client.calls
    assert call.finish_reason == "stop" and call.response_ids == output
    assert call.weight_spans == [("default", 0), (V1, 5)] and call.weight_version == V1
    (span,) = [s for s in span_exporter.get_finished_spans() if s.name == "chat tiny"]
    assert span.attributes["agentarium.weight_spans.versions"] == ("default", V1)
    assert span.attributes["agentarium.weight_spans.starts"] == (0, 5)
    tokens, tis = trained_staleness(call, version=2, max_staleness=1)
    assert tokens == {2: 5, 1: 5} and tis == [1] * 5 + [0] * 5


def test_a_call_without_an_update_has_no_spans_and_bad_spans_are_refused():
    meta = {"weight_version": V1}
    # one version (or no list): every token came from weight_version
    assert weight_spans(None, 4, V1) == [] == weight_spans([{"version": V1, "start": 0}], 4, V1)
    assert weight_spans(
        [{"version": "default", "start": 0, "end": 1}, {"version": V1, "start": 1, "end": 4}],
        4,
        meta["weight_version"],
    ) == [("default", 0), (V1, 1)]
    for listed, problem in (
        ([{"version": "default", "start": 1}, {"version": V1, "start": 2}], "not 0"),
        ([{"version": "default", "start": 0}, {"version": V1, "start": 4}], "of a response of 4"),
        (
            [{"version": V1, "start": 0}, {"version": "default", "start": 2}],
            "is not weight_version",
        ),
        ([{"version": "default", "start": 0}, {"version": V1, "start": 0}], "strictly increasing"),
        ([{"version": 3, "start": 0}], "holds"),
    ):
        with pytest.raises(ValueError, match=problem):
            weight_spans(listed, 4, V1)

    def call(**fields) -> LLMCall:
        base = dict(prompt_ids=[1], response_ids=[2, 3, 4], response_logprobs=[-1.0] * 3)
        return LLMCall(**{**base, "finish_reason": "stop", **fields})

    assert call().weight_spans == [] and call().version_spans() == [("default", 0, 3)]
    spanned = call(weight_version=V1, weight_spans=[["default", 0], [V1, 2]])
    assert spanned.token_versions() == ["default", "default", V1]
    for bad in ([["default", 0], [V1, 3]], [[V1, 1]], [["default", 0]], [[V1, "0"]], "x"):
        with pytest.raises(SchemaError) as caught:
            call(weight_version=V1, weight_spans=bad)
        assert caught.value.field == "llmcall.weight_spans"
    # a reader in another language sends JSON pairs
    data = loads(encode_json(Trajectory(
        job_id="j", agent="a", task_id="t", group_id="g", status="ok", reward=0.0, calls=[spanned]
    )))  # fmt: skip
    assert data["calls"][0]["weight_spans"] == [["default", 0], [V1, 2]]


def test_the_dashboard_and_show_name_every_tokens_weights():
    from agentarium.commands.trajectories_cmd import table_row
    from agentarium.dashboard.summaries import trajectory_row

    def shown(*calls: LLMCall) -> tuple[str, str]:
        t = Trajectory(
            job_id="j", agent="a", task_id="t", group_id="g", run=RUN, status="ok", reward=1.0,
            calls=list(calls),
        )  # fmt: skip
        return trajectory_row(t, seq=1, trace_url="")["weight_version"], table_row(t).split()[7]

    def call(version: str, spans=()) -> LLMCall:
        return LLMCall(
            prompt_ids=[1], response_ids=[2, 3, 4], response_logprobs=[-1.0] * 3,
            finish_reason="stop", weight_version=version, weight_spans=list(spans),
        )  # fmt: skip

    v2, v3 = served(RUN, 2), served(RUN, 3)
    assert shown(call(v3)) == ("spans@3", "spans@3")  # the checksum left out
    assert shown(call(v3, [(v2, 0), (v3, 1)])) == ("spans@2..spans@3",) * 2  # a span counts
    assert shown(call("default"), call(served("other", 9))) == ("default,other@9",) * 2
    assert shown(call("sglang-v1.2")) == ("sglang-v1.2",) * 2  # a server's own, as it said
