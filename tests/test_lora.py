"""LoRA (``--lora-rank``): only the adapters train and are published; the syncer hands each
version to the real local engine through ``/load_lora_adapter``, generations that name the
adapter report its version, the base weights stay as they were (in the trainer and, once the
adapter is unloaded, on the engine), and ``agentarium merge-lora`` folds it into the base."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from trainlib import one_call_group, publish

from agentarium.cli import main
from agentarium.consumers.backends.base import GenerateRequest
from agentarium.consumers.backends.sglang import SGLangBackend
from agentarium.inference import EngineControl, lora_config_of
from agentarium.inference.sync import SyncConfig, WeightSyncer
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.loop import Trainer
from agentarium.trainer.process import TrainerProcess, publisher_for
from agentarium.trainer.step import load_model
from agentarium.trainer.weights import WeightStore

pytestmark = pytest.mark.kernels  # run again under ATEN_CPU_CAPABILITY=avx2 (ops/test.sh)

pytest.importorskip("peft")
torch.set_num_threads(1)
RUN, AGENT = "lora", "a"
PROMPT = [257, 48, 258]


def config(tiny_dir, **extra) -> TrainerConfig:
    values = dict(
        run=RUN,
        agent=AGENT,
        model_dir=str(tiny_dir),
        group_size=4,
        groups_per_step=2,
        lr=3e-2,
        lora_rank=4,
        lora_alpha=8,
    )
    return TrainerConfig(**{**values, **extra})


async def test_the_engine_serves_each_new_adapter_and_the_base_stays(
    js, topology, tiny_dir, engine_url, tmp_path
):
    for g in range(4):
        group = one_call_group(
            g,
            run=RUN,
            agent=AGENT,
            job_id=lambda g, i: f"j{g}{i}",
            group_id=f"g{g}",
            reward=lambda g, i: float(i == g % 4),
        )
        await publish(js, topology, group)
    trainer = Trainer(
        config(tiny_dir),
        js,
        topology=topology,
        publisher=WeightStore(js, topology, weights_dir=tmp_path / "w").for_run(RUN),
    )
    syncer = WeightSyncer(
        js,
        SyncConfig(run=RUN, engines=(engine_url,), weights_dir=tmp_path / "sync"),
        topology=topology,
    )
    backend = SGLangBackend([engine_url], lora=RUN)  # what `consumer --lora lora` sends
    control = EngineControl()
    base = await control.weights_checksum(engine_url)
    try:
        served = []
        for steps in (0, 1, 2):  # the initial adapter (v1, before any step), then one a step
            await trainer.run(max_steps=steps)
            await syncer.sync_once()
            result = await backend.generate(
                GenerateRequest(
                    input_ids=PROMPT, sampling={"max_new_tokens": 1, "temperature": 1.0}
                )
            )
            served.append((result.weight_version, (await control.weights_checksum(engine_url))))
        # what the calls record advances, each the identity of this run's adapter version
        assert [v.split(":")[0] for v, _ in served] == ["lora@1", "lora@2", "lora@3"]
        sums = [c["checksum"] for _, c in served]
        assert sums[0] == base["checksum"]  # the initial adapter adds nothing (B = 0)
        assert len({base["checksum"], sums[1], sums[2]}) == 3

        # what was published is the adapter alone
        file = tmp_path / "w" / RUN / "v3" / "model.safetensors"
        assert lora_config_of(file)["r"] == 4
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            assert f.keys() and all(".lora_A." in k or ".lora_B." in k for k in f.keys())
        assert file.stat().st_size < 100_000 < base["bytes"]

        # the trainer's base is untouched: only adapters train
        model = trainer._updater.model
        assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
        initial = load_model(tiny_dir, "cpu", trainable=False)
        ids = torch.tensor([PROMPT])
        # the same weights through the same kernels on the same shapes (one thread): bitwise
        # equal, on both kernel sets; any difference is a base weight that moved
        with torch.no_grad(), model.disable_adapter():
            assert torch.equal(model(input_ids=ids).logits, initial(input_ids=ids).logits)

        # and so is the engine's, once the adapter is out
        await control.unload_lora_adapter(engine_url, name=RUN)
        assert (await control.weights_checksum(engine_url))["checksum"] == base["checksum"]
    finally:
        await backend.aclose()
        await control.close()
        await syncer.close()

    # merge for export: one command, an ordinary model that answers as base + adapter
    out = tmp_path / "merged"
    argv = ["merge-lora", "--model", str(tiny_dir), "--adapter", str(file), "--out", str(out)]
    assert main(argv) == 0
    assert (out / "tokenizer.json").is_file()
    export = load_model(out, "cpu", trainable=False)
    # Merged, (W + s BA) x, against the adapter beside the base, W x + s B (A x), both fp32:
    # the merge rounds each weight once (u = 2**-24 of |W + s BA|) and the sums run in other
    # orders. Per matmul ~sqrt(K) u sum|w x| (Higham and Mary's probabilistic bound; K <= 256,
    # sum|W h| ~2.1 at the head, the largest), 15 matmuls, two computations: 2 * 15 * 16 *
    # 6e-8 * 2.1 = 6e-5, the merge's roundings 15 * 6e-8 * 2.1 = 2e-6 more. The tolerance,
    # 3e-4, is 5x that (measured 2.4e-7-3.6e-7, both kernel sets); the adapter itself moves
    # these logits by 0.75-1.29, so one lost or applied twice is 2,500x over it.
    with torch.no_grad():
        torch.testing.assert_close(
            export(input_ids=ids).logits, model(input_ids=ids).logits, atol=3e-4, rtol=0
        )


def test_lora_cannot_stream_and_needs_a_rank(tiny_dir):
    from agentarium.trainer.errors import TrainerConfigError

    process = TrainerProcess(weight_transport="stream", stream_engines=("http://x:1",))
    with pytest.raises(TrainerConfigError, match="use object-store or shared-path"):
        publisher_for(config(tiny_dir), process)
    with pytest.raises(TrainerConfigError, match="lora-rank"):
        config(tiny_dir, lora_rank=-1)
    with pytest.raises(TrainerConfigError, match="lora-alpha"):
        config(tiny_dir, lora_alpha=0)


async def test_the_syncer_loads_an_adapter_with_sglangs_calls(
    js, topology, fake, tiny_dir, tmp_path
):
    """Against the SGLang fake (which refuses fields SGLang does not define): the calls and
    their order, and a generation that names the adapter reports its version."""
    from agentarium.trainer.step import LocalUpdater

    adapter = LocalUpdater(config(tiny_dir)).publishable_model()
    store = WeightStore(js, topology, weights_dir=tmp_path / "w")
    await store.publish(adapter, run=RUN, version=1)
    syncer = WeightSyncer(
        js,
        SyncConfig(run=RUN, engines=(fake.url,), weights_dir=tmp_path / "sync"),
        topology=topology,
    )
    try:
        result = await syncer.sync_once()
    finally:
        await syncer.close()
    assert result is not None and result.ok, result
    paths = [path for path, _ in fake.control]
    assert paths == [
        "/pause_generation",
        "/unload_lora_adapter",  # refused, nothing loaded yet: fine
        "/load_lora_adapter",
        "/update_weight_version",
        "/continue_generation",
    ]
    load, version = fake.control[2][1], fake.control[3][1]
    assert load["lora_name"] == RUN and (tmp_path / "sync" / RUN / "v1" / "lora") == Path(
        load["lora_path"]
    )
    assert version == {"new_version": result.identity, "abort_all_requests": False}
    assert result.identity.startswith(f"{RUN}@1:")
    backend = SGLangBackend([fake.url], lora=RUN)
    try:
        result = await backend.generate(GenerateRequest(input_ids=PROMPT, sampling={}))
    finally:
        await backend.aclose()
    assert result.weight_version == version["new_version"] and fake.requests[-1]["lora_path"] == RUN


def test_an_adapter_on_a_tied_head_changes_the_head_alone(tmp_path):
    """SmolLM2 ties its output head to its input embedding (``tie_word_embeddings``); the
    demo's LoRA targets include ``lm_head``. PEFT adapts the head alone in the trainer; the
    engine must serve that (not refuse it, not fold it into the embedding too), and restore the
    tie when the adapter comes out; ``merge-lora`` must export it the same way."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentarium.demo.run import LORA_TARGETS
    from agentarium.inference import adapter_directory
    from agentarium.inference.engine.lora import Adapter, AdapterSlot
    from agentarium.trainer.lora import AdapterExport, merge_lora, with_lora

    torch.manual_seed(0)
    shape = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4)
    tied = LlamaConfig(
        vocab_size=96, num_hidden_layers=2, num_key_value_heads=2, tie_word_embeddings=True, **shape
    )
    LlamaForCausalLM(tied).save_pretrained(tmp_path / "base")
    policy = with_lora(
        load_model(tmp_path / "base", "cpu"), rank=4, alpha=8, target_modules=LORA_TARGETS
    )
    with torch.no_grad():  # a trained adapter: B != 0 everywhere, the head's included
        for name, p in policy.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    file = AdapterExport(policy).save_pretrained(tmp_path)
    adapter = Adapter.read("v1", adapter_directory(file, tmp_path / "adapter"))
    assert "lm_head.weight" in adapter.deltas

    served = load_model(tmp_path / "base", "cpu", trainable=False)
    embedding, head = served.model.embed_tokens, served.lm_head
    assert head.weight is embedding.weight
    base_embedding = embedding.weight.detach().clone()
    ids = torch.tensor([[3, 17, 40, 5, 91]])
    with torch.no_grad():
        base_logits = served(input_ids=ids).logits
        want = policy(input_ids=ids).logits
    # The engine (and merge-lora, below) fold s BA into the weights, peft keeps it beside them.
    # As in test_the_engine_serves_each_new_adapter_and_the_base_stays: per matmul ~sqrt(K) u
    # sum|w x| (K <= 64 here, sum|W h| <= 2.14, at the head), 15 matmuls, two computations:
    # 2 * 15 * 8 * 6e-8 * 2.14 = 3.1e-5, the fold's roundings 15 * 6e-8 * 2.14 = 1.9e-6 more;
    # 1e-4 is 3x that (measured 3.9e-7 on both kernel sets), and the adapter moves these logits
    # by 0.15 (median; up to 1.1), so one not loaded or loaded twice is 1,500x over it.
    tol = dict(atol=1e-4, rtol=0)
    slot = AdapterSlot()
    for _ in range(2):  # loading over the loaded adapter takes it out first
        slot.load(served, adapter)
        with torch.no_grad():
            torch.testing.assert_close(served(input_ids=ids).logits, want, **tol)
        assert torch.equal(embedding.weight, base_embedding)  # the input embedding is the base's
    slot.unload(served)
    assert served.lm_head.weight is embedding.weight  # tied again
    with torch.no_grad():
        assert torch.equal(served(input_ids=ids).logits, base_logits)

    # new base weights over a loaded adapter: the head follows the new embedding again
    slot.load(served, adapter)
    with torch.no_grad():
        embedding.weight.mul_(2)
    slot.forget(served)
    assert served.lm_head.weight is embedding.weight and slot.name is None

    merged = merge_lora(tmp_path / "base", file, tmp_path / "merged")
    export = load_model(merged, "cpu", trainable=False)
    assert torch.equal(export.model.embed_tokens.weight, base_embedding)
    with torch.no_grad():
        torch.testing.assert_close(export(input_ids=ids).logits, want, **tol)  # as above


async def test_a_lora_trainer_refuses_token_ids_outside_the_vocabulary(
    js, topology, tiny_dir, tmp_path
):
    """With LoRA the trainer publishes an adapter, not the model; the vocabulary it checks
    trajectories against is still the model's. A token id the embedding cannot look up is a
    refused trajectory, said so in the log, never a step that crashes on it."""
    import dataclasses

    import structlog.testing

    run = "lora-vocab"
    groups = [
        one_call_group(
            g,
            run=run,
            agent=AGENT,
            job_id=lambda g, i: f"v{g}{i}",
            group_id=f"vg{g}",
            reward=lambda g, i: float(i == g % 4),
        )
        for g in range(3)
    ]
    poisoned = groups[2][0]
    call = poisoned.calls[0]
    poisoned.calls[0] = dataclasses.replace(call, response_ids=[100_000, *call.response_ids[1:]])
    for group in groups:
        await publish(js, topology, group)
    trainer = Trainer(
        config(tiny_dir, run=run),
        js,
        topology=topology,
        publisher=WeightStore(js, topology, weights_dir=tmp_path / "w").for_run(run),
    )
    with structlog.testing.capture_logs() as logs:
        await asyncio.wait_for(trainer.run(max_steps=1), timeout=120)
    refused = [e for e in logs if e.get("event", "").startswith("trajectory kept out of training")]
    assert [e["job_id"] for e in refused] == [poisoned.job_id]
    assert "token id 100000 in response_ids, outside the model's vocabulary" in refused[0]["reason"]
    assert trainer._updater.model.get_input_embeddings().num_embeddings < 100_000
