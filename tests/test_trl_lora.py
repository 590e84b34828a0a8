"""TRL's GRPOTrainer with a peft LoRA config: the adapter alone is published after each step,
the syncer loads it into the real local engine, which serves its base + the adapter (the
trajectories record each step's new version), and the base weights stay as they were, in
TRL's model and on the engine.

A module of its own: its engine (one per module) serves the tiny model's base weights when the
test starts, which a full-weights run in the same module would have replaced."""

from __future__ import annotations

import pytest

pytest.importorskip("trl", reason="TRL is the `trl` extra: pip install -e '.[trl]'")
pytest.importorskip("peft", reason="LoRA is the `lora` extra: pip install -e '.[lora]'")

import torch  # noqa: E402
from peft import LoraConfig, get_peft_model  # noqa: E402
from safetensors import safe_open  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402
from trllib import VersionsSeen, services_running  # noqa: E402

from agentarium.examples.toy import messages_of  # noqa: E402
from agentarium.examples.trl_trainer import grpo_trainer  # noqa: E402
from agentarium.inference import EngineControl, lora_config_of  # noqa: E402
from agentarium.integrations.config import RolloutConfig  # noqa: E402
from agentarium.integrations.trl import AgentariumRollout, AgentariumWeightSync  # noqa: E402
from agentarium.trainer import TrainerConfigError, TrainerProcess, peft_adapter  # noqa: E402

RUN, AGENT, STEPS, RANK = "trl-lora", "digit", 3, 4


async def first_char(task: dict, llm) -> dict:
    """A reward that differs within a group (the reply's one token by its id, scaled to
    [0, 1]), so every step has an advantage to train on: a group of 4 of the near-uniform
    tiny model is flat with p ~ 5e-8 (tests/test_sync_mode.py; by the decoded character it
    was ~0.056, the 128 byte ids 128-255 all decoding to U+FFFD). With ``any_digit`` (0/1; the
    tiny model starts near 0.04) a group of 4 was flat with p ~ 0.85 and all 12 groups with
    p ~ 0.14, as in CI's run at 8add217: no gradient, the adapter's B stayed zero and the
    engine served its base unchanged."""
    result = await llm.chat(messages_of(task), max_new_tokens=1)
    return {"reward": result.call.response_ids[0] / 262, "metrics": {}}


async def full_run_on(settings, engine_url, model, weights_dir) -> None:
    """Run ``full`` publishes ``model``'s whole weights and its syncer loads them (then stops,
    so another run may take the engine over)."""
    from agentarium.broker import Topology
    from agentarium.inference.sync import SyncConfig, WeightSyncer
    from agentarium.trainer.weights import WeightStore

    nc = await settings.connect(name="full-run")
    try:
        js = nc.jetstream()
        await WeightStore(js, Topology()).publish(model, run="full", version=5)
        config = SyncConfig(run="full", engines=(engine_url,), weights_dir=weights_dir)
        result = await WeightSyncer(js, config, topology=Topology()).sync_once()
        assert result.ok and result.identity.startswith("full@5:"), result
    finally:
        await nc.close()


def _base(tiny_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()


def test_trl_trains_a_lora_adapter_and_the_engine_serves_base_plus_adapter(
    settings, tiny_dir, engine_url, tmp_path
):
    """False-failure rate: what is left to chance (the engine's sampling, seeded by the OS) is
    whether any of the 12 groups of 4 has spread, which the adapter's B needs to leave zero. A
    group is flat when its 4 replies start with the same character: sum_c q_c^4 <= max_c q_c^3,
    and the near-uniform tiny model gives no first character (nor the empty reply) more than
    q = 0.05 (uniform over its 263 tokens is 0.004): 1.3e-4 a group, and all 12 flat
    (1.3e-4)^12 < 1e-46. Everything else it asserts is deterministic.

    Before it, a full fine-tuning run (``full``) leaves its weights on the engine, as the run
    before a LoRA experiment would: the LoRA run's syncer restores the base weights before its
    first adapter, so the adapter trains and serves on the base, not on the other run's."""
    torch.manual_seed(0)
    control = EngineControl()
    full = _base(tiny_dir)
    with torch.no_grad():
        for param in full.parameters():
            param.mul_(1.5)  # visibly other weights
    seen = VersionsSeen()
    with services_running(
        settings,
        name="trl-lora-services",
        run=RUN,
        agent=AGENT,
        agent_fn=first_char,
        engine_url=engine_url,
        weights_dir=tmp_path / "sync",
    ) as loop:
        try:
            base_sum = loop.call(control.weights_checksum(engine_url))
            loop.call(full_run_on(settings, engine_url, full, tmp_path / "full"))
            assert loop.call(control.weights_checksum(engine_url)) != base_sum
            config = RolloutConfig(agent=AGENT, run=RUN, deadline_s=60, grace_s=30)
            with AgentariumRollout(config, settings=settings) as rollouts:
                trainer = grpo_trainer(
                    rollouts,
                    model_dir=str(tiny_dir),
                    steps=STEPS,
                    lr=3e-2,
                    prompts_per_step=4,
                    generations=4,
                    output_dir=str(tmp_path / "trl"),
                    seed=1,
                    extra_rewards=[seen],
                    lora_rank=RANK,
                )
                [sync] = [
                    c
                    for c in trainer.callback_handler.callbacks
                    if isinstance(c, AgentariumWeightSync)
                ]
                trainer.train()
                rollouts.wait_served(STEPS + 1)  # the last step's, which no rollout waited for
            served = loop.call(control.weights_checksum(engine_url))
            # the engine's own base, once the adapter is taken out
            loop.call(control.unload_lora_adapter(engine_url, name=RUN))
            unloaded = loop.call(control.weights_checksum(engine_url))
        finally:
            loop.call(control.close())

    # one version at train begin (TRL's starting adapter), then one a step; step s sampled
    # version s, the one published after the step before
    assert sync.published == list(range(1, STEPS + 2)), sync.published
    assert seen.steps == [{s} for s in range(1, STEPS + 1)], seen.steps
    assert served["weight_version"].startswith(f"{RUN}@{STEPS + 1}:")
    # the engine served its base + the trained adapter, and its base is intact
    assert served["checksum"] != base_sum["checksum"]
    assert unloaded["checksum"] == base_sum["checksum"]

    # what was published is the adapter alone, as the syncer fetched it
    file = tmp_path / "sync" / RUN / f"v{STEPS + 1}" / "model.safetensors"
    assert lora_config_of(file)["r"] == RANK
    with safe_open(str(file), "pt") as f:
        keys = list(f.keys())
        assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
        assert any(bool(f.get_tensor(k).any()) for k in keys if ".lora_B." in k)  # trained
    assert file.stat().st_size < 100_000 < base_sum["bytes"]

    # TRL trained the adapter only: its base weights are the model it loaded, tensor for tensor
    model = trainer.model
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad)
    loaded = _base(tiny_dir).state_dict()
    base = {
        n.replace("base_layer.", ""): p
        for n, p in model.get_base_model().named_parameters()
        if "lora_" not in n
    }
    assert base.keys() == {n for n, _ in _base(tiny_dir).named_parameters()}
    for name, tensor in base.items():
        assert torch.equal(tensor.detach().float(), loaded[name]), name


def test_only_peft_lora_models_the_engines_can_serve_publish_an_adapter(tiny_dir):
    assert peft_adapter(_base(tiny_dir)) is None  # no peft: the whole model is published

    def lora(**extra):
        config = dict(r=RANK, lora_alpha=8, target_modules=["q_proj", "v_proj"])
        return get_peft_model(_base(tiny_dir), LoraConfig(**{**config, **extra}))

    export = peft_adapter(lora())
    assert export is not None and export.config()["r"] == RANK
    assert export.state() and all("lora_" in k for k in export.state())
    with pytest.raises(TrainerConfigError, match="DoRA"):
        peft_adapter(lora(use_dora=True))
    with pytest.raises(TrainerConfigError, match="ranks per module"):
        peft_adapter(lora(rank_pattern={"q_proj": 8}))
    with pytest.raises(TrainerConfigError, match="beside its LoRA A and B.*modules_to_save"):
        peft_adapter(lora(modules_to_save=["lm_head"]))
    # and the stream transport, which broadcasts whole tensors, is refused for an adapter
    rollout = AgentariumRollout(RolloutConfig(agent=AGENT, run=RUN))
    sync = rollout.weight_sync(
        model_dir=str(tiny_dir),
        process=TrainerProcess(weight_transport="stream", stream_engines=("http://x:1",)),
    )
    with pytest.raises(TrainerConfigError, match="TRL's peft model.*object-store or shared"):
        sync.on_train_begin(None, None, None, model=lora())
