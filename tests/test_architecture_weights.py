"""Training and publishing on the architectures beyond the tiny Qwen2 (agentarium/
tiny_families.py): ``--parallel fsdp`` (FSDP2 over 2 Ray actors, gloo) takes the step a
one-process trainer takes on each, and the weights it gathers, published through the object
store and loaded by the local engine, are what the engine then serves: its log-probs are the
trained model's, not the base's. A LoRA step's adapter, loaded as the syncer loads it, is
served the same way.

One Ray session serves the module; each architecture starts its own pair of ranks. Not marked
``kernels``: its comparisons were measured under both kernel sets (the tolerance note below),
and the engine-against-trainer bound it reuses runs under both in tests/test_architectures.py;
a second pass would cost the avx2 tier ~40 s."""

from __future__ import annotations

import pytest
import torch
from updatelib import batch_of

from agentarium.inference import sha256_file
from agentarium.inference.engine import LocalEngine
from agentarium.tiny_families import ARCHITECTURES, ensure_tiny_architecture
from agentarium.trainer.config import TrainerConfig
from agentarium.trainer.step import LocalUpdater, load_model
from agentarium.trainer.weights import WeightStore

ray = pytest.importorskip("ray")
torch.set_num_threads(1)
PROMPT = list(b"The weather in Paris, then Rome:")
MOE = {"qwen3_moe", "mixtral"}  # grouped expert products: no fp64 kernel


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def config(model_dir, arch: str, **extra) -> TrainerConfig:
    values = dict(
        run="r",
        agent="a",
        model_dir=str(model_dir),
        lr=1e-2,  # one step moves the served log-probs far beyond the engine's tolerance
        kl_coef=0.05,
        grad_clip=1.0,
        group_size=4,
        groups_per_step=2,
        parallel="fsdp",
        ray_workers=2,
        micro_batch_size=2,
        dtype="float32" if arch in MOE else "float64",
    )
    return TrainerConfig(**{**values, **extra})


def log_probs(model, ids: list[int]) -> torch.Tensor:
    """The log-probs ``model`` gives the tokens of ``ids`` after PROMPT (fp32)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0].float()
    picked = torch.log_softmax(logits, dim=-1)[len(PROMPT) - 1 : -1]
    return picked.gather(1, torch.tensor(ids[len(PROMPT) :])[:, None])[:, 0]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
async def test_fsdp_trains_each_architecture_and_the_engine_serves_what_it_published(
    arch, ray_session, js, topology, tmp_path
):
    from agentarium.trainer.fsdp import FsdpParallel

    model_dir = ensure_tiny_architecture(arch)
    local = LocalUpdater(config(model_dir, arch, parallel="replicated", ray_workers=0))
    sharded = FsdpParallel(config(model_dir, arch), 2)
    try:
        one, two = local.step(batch_of(5), seed=1), sharded.step(batch_of(5), seed=1)
        gathered = sharded.publishable_model()
    finally:
        sharded.close()
    assert two.loss == pytest.approx(one.loss, rel=1e-5)
    assert two.grad_norm == pytest.approx(one.grad_norm, rel=1e-4)
    want = dict(local.model.named_parameters())
    got = dict(gathered.named_parameters())
    assert got.keys() == want.keys()
    # One AdamW step from zero moments moves each entry by lr * g / (|g| + eps): a rounding
    # difference dg = delta |g| between the two computations (other sums: a reduce-scatter over
    # 2 ranks, other passes) moves it by at most lr * delta / 4 (at |g| = eps). delta ~
    # sqrt(K) u: ~1e-6 in fp32 (the mixtures), ~2e-15 in fp64, so 2.5e-9 and 5e-18; measured
    # 0 to 1.4e-17 on every architecture, AVX-512 and AVX2 kernels. The tolerances leave
    # 400x and more; a shard not reduced or not stepped moves entries by lr = 1e-2.
    tol = 1e-6 if arch in MOE else 1e-10
    for name, tensor in want.items():
        torch.testing.assert_close(got[name], tensor.detach(), atol=tol, rtol=0, msg=name)

    store = WeightStore(js, topology)
    update = await store.publish(gathered, run=f"arch-{arch}", version=1, step=1)
    path = await store.fetch(update, tmp_path / "fetched")
    assert sha256_file(path)[0] == update.sha256
    async with LocalEngine(model_dir) as engine:
        loaded = await engine.update_weights_from_disk({"model_path": str(path.parent)})
        assert loaded["success"], loaded
        out = await engine.generate(
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5},
                "return_logprob": True,
            }
        )
    served = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    ids = PROMPT + out["output_ids"]
    trained = log_probs(local.model, ids)
    base = log_probs(load_model(model_dir, "cpu", trainable=False, dtype="float32"), ids)
    # the engine test's bound (tests/test_architectures.py), fp32 against the trainer's model;
    # measured <= 9.5e-7 on both kernel sets, and the step moves them by 0.14-0.25
    assert float((served - trained).abs().max()) <= 1e-4
    assert float((served - base).abs().max()) > 1e-2  # it serves the update, not the base


@pytest.mark.parametrize("lose", ["experts.1.up_proj", "input_layernorm"])
def test_a_mixtures_checkpoint_missing_a_tensor_is_refused_and_the_weights_kept(lose, tmp_path):
    """The engine reads a mixture's checkpoint (one tensor per expert) through transformers'
    conversion, which fills what is missing with a fresh draw: a checkpoint short of one
    expert's tensor, or of a norm, is refused instead, the served weights untouched."""
    from safetensors.torch import load_file, save_file

    from agentarium.inference.engine.errors import WeightLoadError
    from agentarium.inference.engine.model import EngineModel

    model_dir = ensure_tiny_architecture("qwen3_moe")
    engine = EngineModel(model_dir)
    state = load_file(str(model_dir / "model.safetensors"))
    assert any(".experts.0." in name for name in state)  # the checkpoint's own format
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    save_file({k: v * 2 for k, v in state.items() if lose not in k}, tmp_path / "model.safetensors")
    with pytest.raises(WeightLoadError, match="do not fit the served model"):
        engine.load_weights(tmp_path)
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, before[name]), name


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
async def test_a_lora_step_on_each_architecture_is_served_as_an_adapter(arch, tmp_path):
    """A rank-4 LoRA step (``all-linear``: a mixture's experts left alone), its adapter exported
    as the trainer publishes it and loaded into the local engine, which then serves the
    adapted model's log-probs."""
    pytest.importorskip("peft")
    from agentarium.inference import adapter_directory

    model_dir = ensure_tiny_architecture(arch)
    extra = dict(lora_rank=4, lora_alpha=8, lr=3e-2, dtype="float32")
    local = LocalUpdater(config(model_dir, arch, parallel="replicated", ray_workers=0, **extra))
    local.step(batch_of(5), seed=1)
    file = local.publishable_model().save_pretrained(tmp_path)
    adapter = adapter_directory(file, tmp_path / "adapter")
    async with LocalEngine(model_dir) as engine:
        loaded = await engine.load_lora_adapter({"lora_name": "a", "lora_path": str(adapter)})
        assert loaded["success"], loaded
        out = await engine.generate(
            {
                "input_ids": PROMPT,
                "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "sampling_seed": 5},
                "return_logprob": True,
                "lora_path": "a",
            }
        )
    served = torch.tensor([lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]])
    ids = PROMPT + out["output_ids"]
    trained = log_probs(local.model, ids)
    base = log_probs(load_model(model_dir, "cpu", trainable=False, dtype="float32"), ids)
    # fp32, the adapter folded into the weights against peft's B A beside them: the bound of
    # tests/test_lora.py's tied-head test and of the engine test above, 1e-4 (measured
    # <= 9.5e-7 on both kernel sets; the step moves them by 0.14-0.25)
    assert float((served - trained).abs().max()) <= 1e-4
    assert float((served - base).abs().max()) > 1e-2
