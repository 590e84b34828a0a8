"""The real-model tier: SmolLM2-135M-Instruct (``--model smol``) through the local engine, the
tracing client, the consumer's checks, the trainer's log-probs and the weight flow.

Everything else in the suite runs on the tiny model (byte-level tokens, a template with tools);
this tier runs what only a real model shows: a 49,152-token BPE vocabulary, ChatML with
``<|im_end|>`` as the end of turn, a chat template that reads no tools, and log-probs the
trainer must reproduce. The model is converted once per run (conftest's ``smol_dir``, about a
minute of CPU on 2 cores) and served by one engine for the module; select the tier with
``-m real_model``. Without the ``smol`` extra it is skipped (failed under ``CI=true``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
import pytest
import torch
from agentlib import add_tool
from fake_sglang import local_engine

from agentarium.broker import Topology
from agentarium.consumers import (
    ConsumerService,
    ConsumerSettings,
    ConsumerSpec,
    LLMTarget,
    TokenizerMismatch,
    TracingLLM,
)
from agentarium.consumers.backends import SGLangBackend
from agentarium.examples import toy
from agentarium.formats import ChatTemplate, ToolsNotRendered
from agentarium.inference.sync import SyncConfig, WeightSyncer
from agentarium.schemas import Sampling, Trajectory, WeightIdentity

pytestmark = pytest.mark.real_model
torch.set_num_threads(1)

# The largest |engine - trainer| log-prob of a sampled token measured here over 8 replies of 4
# prompts (307 tokens, temperature 1; fp32 both sides, the engine's batched left-padded rows
# against the trainer's right-padded ones) was 2.2e-5; the bound leaves a 20x margin for other
# CPUs' kernels.
LOGPROB_BOUND = 5e-4
IM_END = 2  # SmolLM2's <|im_end|>
PROMPTS = [
    [{"role": "user", "content": "Say hi."}],
    [
        {"role": "system", "content": "Answer with one word."},
        {"role": "user", "content": "Capital of France?"},
    ],
    [  # two turns, with text whose BPE merges span spaces, newlines and accents
        {"role": "user", "content": "What is 3+4?"},
        {"role": "assistant", "content": "7"},
        {"role": "user", "content": "héllo ✓ and\n\n  twice that?"},
    ],
]
TOOLS = [add_tool("Add two numbers.", ("a",))]


@pytest.fixture(scope="module")
def smol_template(smol_dir) -> ChatTemplate:
    return ChatTemplate.from_model_dir(smol_dir)


@pytest.fixture(scope="module")
def smol_url(smol_dir):
    with local_engine(smol_dir) as url:
        yield url


@pytest.fixture(scope="module")
def calls(smol_url, smol_template):
    """Sampled calls (temperature 1, seeded) of every prompt, through the tracing client."""

    async def sample():
        backend = SGLangBackend([smol_url], backoff=0.0)
        llm = TracingLLM(
            backend,
            smol_template,
            job_sampling=Sampling(temperature=1.0, max_new_tokens=24),
            route_key="g",
            rid_prefix="real",
            model_name="smol",
        )
        try:
            return await asyncio.gather(*(llm.chat(p, seed=11) for p in PROMPTS))
        finally:
            await backend.aclose()

    return asyncio.run(sample())


def test_prompt_ids_are_the_chat_templates_and_replies_decode_to_their_text(smol_dir, calls):
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(smol_dir)
    assert len(hf) == 49152 and hf.eos_token == "<|im_end|>"
    for messages, result in zip(PROMPTS, calls, strict=True):
        encoded = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        want = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        call = result.call
        assert call.prompt_ids == list(want)
        assert call.prompt_ids[-4:] == hf.encode(
            "<|im_start|>assistant\n", add_special_tokens=False
        )
        assert hf.decode(call.response_ids, skip_special_tokens=True) == result.text
        assert len(call.response_logprobs) == len(call.response_ids) > 0


def test_a_reply_ends_on_im_end(smol_url, smol_template):
    assert smol_template.eos_token_ids == [IM_END]

    async def greedy():
        backend = SGLangBackend([smol_url], backoff=0.0)
        llm = TracingLLM(backend, smol_template, job_sampling=Sampling(temperature=0.0))
        try:
            return await llm.chat(PROMPTS[0], max_new_tokens=32)
        finally:
            await backend.aclose()

    result = asyncio.run(greedy())
    assert result.finish_reason == "stop" and result.call.response_ids[-1] == IM_END
    assert result.text and "<|im_end|>" not in result.text


@pytest.mark.kernels  # log-probs compared: run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)
def test_the_trainer_reproduces_the_engines_logprobs(smol_dir, calls):
    from agentarium.trainer.batch import Sample, build_rows, collate
    from agentarium.trainer.logprobs import token_stats
    from agentarium.trainer.step import StepSettings, load_model

    samples = [
        Sample(
            Trajectory(
                job_id=f"j{i}", agent="a", task_id="t", group_id="g", status="ok", reward=1.0,
                calls=[result.call],
            ),
            1.0,
        )
        for i, result in enumerate(calls)
    ]  # fmt: skip
    rows, _ = build_rows(samples)
    batch = collate(rows, pad_id=IM_END)
    model = load_model(smol_dir, "cpu", trainable=False)
    with torch.no_grad():  # as trainer.step.forward_backward takes them (chunked, fp32) ...
        chunked = token_stats(model, batch, chunk=StepSettings().logprob_chunk).logprobs
        whole = token_stats(model, batch, chunk=0).logprobs  # ... and the whole-vocabulary way
    mask = batch.loss_mask[:, 1:].bool()
    assert int(mask.sum()) == sum(len(r.call.response_ids) for r in calls)
    for logprobs in (chunked, whole):
        diff = (logprobs - batch.old_logprobs[:, 1:])[mask].abs()
        assert diff.max().item() < LOGPROB_BOUND, diff.max().item()
    # The chunked and whole paths against each other in float64: the decoder's pass is the same
    # and only the head (K = 576) and log-softmax (V = 49,152) sum in other orders. In fp32 that
    # was ~2 * sqrt(576) u * sum|W h| (<= 215 on smol's head) = 6e-4, doubled by log-softmax,
    # above a useful tolerance; in fp64 even the worst case, n u * 215 with n = 576 for the
    # head (1.4e-11) and n u = 5.5e-12 for the sum of 49,152 exponentials, is under 3e-11
    # (measured 0.0, the same kernels), so 1e-9 leaves 30x; a position or temperature missed
    # by the chunking moves a log-prob by >= 1e-3.
    del model
    model = load_model(smol_dir, "cpu", trainable=False, dtype="float64")
    with torch.no_grad():
        chunked = token_stats(model, batch, chunk=StepSettings().logprob_chunk).logprobs
        whole = token_stats(model, batch, chunk=0).logprobs
    assert chunked.dtype == torch.float64
    torch.testing.assert_close(chunked[mask], whole[mask], atol=1e-9, rtol=0)


async def test_a_consumer_with_another_tokenizer_is_refused_naming_both(js, smol_url, tiny_dir):
    def spec(model_dir: Path, name: str) -> ConsumerSpec:
        return ConsumerSpec(
            agent="real",
            fn=toy.rollout,
            target=LLMTarget(urls=(smol_url,)),
            model_dir=str(model_dir),
            model_name=name,
            settings=ConsumerSettings.of(concurrency=1, proxy_host="127.0.0.1", proxy_port=0),
        )

    with pytest.raises(TokenizerMismatch) as refused:
        await ConsumerService(js, Topology(), spec(tiny_dir, "tiny")).start()
    message = str(refused.value)
    served = ChatTemplate.from_model_dir(tiny_dir).fingerprint[:12]
    for part in ("'tiny'", str(tiny_dir), served, smol_url, "smol-135m-instruct", "--model"):
        assert part in message, (part, message)


def test_tools_offered_to_a_template_without_tools_are_an_error(smol_template):
    assert not smol_template.renders_tools()
    with pytest.raises(ToolsNotRendered, match="does not render tools"):
        smol_template.encode_chat(PROMPTS[0], tools=TOOLS)
    # no tools, or an empty list: the template as it is
    assert smol_template.encode_chat(PROMPTS[0], tools=[]) == smol_template.encode_chat(PROMPTS[0])


@pytest.mark.kernels  # the engine's log-probs against transformers': run again under avx2
async def test_published_weights_reach_the_engine_and_change_what_eval_reads(
    js, topology, smol_dir, smol_url, tmp_path
):
    # last in the module: the engine serves the published weights from here on
    from transformers import AutoModelForCausalLM

    from agentarium.evaluation.served import served_weights
    from agentarium.trainer.weights import WeightStore

    trained = AutoModelForCausalLM.from_pretrained(smol_dir, dtype=torch.float32)
    with torch.no_grad():  # a visibly different policy
        for name, param in trained.named_parameters():
            if "mlp.down_proj" in name:
                param.mul_(1.5)
    (before,) = await served_weights([smol_url])
    config = SyncConfig(run="real", engines=(smol_url,), weights_dir=tmp_path / "w", recheck_s=1)
    syncer = WeightSyncer(js, config, topology=topology)
    task = asyncio.create_task(syncer.run())
    async with aiohttp.ClientSession(base_url=smol_url) as http:

        async def version() -> str:
            async with http.get("/model_info") as resp:
                return (await resp.json())["weight_version"]

        try:
            assert await version() == "default"
            update = await WeightStore(js, topology).publish(trained, run="real", version=1, step=1)
            identity = str(WeightIdentity.of(update))  # real@1:<the file's sha256, 16 digits>
            async with asyncio.timeout(120):
                while await version() != identity:
                    await asyncio.sleep(0.2)
        finally:
            syncer.stop()
            await asyncio.wait_for(task, 60)
        prompt = ChatTemplate.from_model_dir(smol_dir).encode_chat(PROMPTS[0])
        body = {
            "input_ids": prompt,
            "sampling_params": {"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": 3},
            "return_logprob": True,
        }
        async with http.post("/generate", json=body) as resp:
            out = await resp.json()
    (after,) = await served_weights([smol_url])
    assert before.startswith("sha256:") and after.startswith("sha256:") and after != before
    assert out["meta_info"]["weight_version"] == identity
    ids = prompt + out["output_ids"]
    with torch.no_grad():
        logits = trained(input_ids=torch.tensor([ids])).logits[0].float()  # (T, V)
    positions = list(range(len(prompt) - 1, len(ids) - 1))
    want = torch.log_softmax(logits, dim=-1)[positions, out["output_ids"]]
    got = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    assert (got - want).abs().max().item() < LOGPROB_BOUND
