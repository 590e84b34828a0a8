"""One GRPO update on a transformers causal LM: forward, loss, backward, clip, AdamW.

``forward_backward`` is shared by the single-process updater below and each data-parallel
worker (trainer/ray_dp.py): it accumulates gradients for a batch or a shard of one, with the
loss normalised by the *whole* batch's counts, so shards' gradients sum to the full gradient.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from . import heap, memory, packing
from .batch import Batch
from .checkpoint import Loaded, write_full
from .chunked_mlp import enable as chunk_feed_forward
from .config import TrainerConfig
from .errors import TrainerConfigError
from .fused_grads import fuse_embedding, fuse_linears
from .grpo import LossSums, grpo_loss, truncated_is_weights
from .logprobs import causal_lm, token_stats
from .optim import Fp8AdamW, moments_of
from .sliced_layers import enable as slice_layers


def _default(name: str) -> Any:
    """TrainerConfig's default of ``name``: a step's settings have no default of their own."""
    default = TrainerConfig.__dataclass_fields__[name].default
    assert default is not MISSING, name
    return default


@dataclass(frozen=True, kw_only=True)
class StepSettings:
    """The part of TrainerConfig a step needs (plain values: it travels to Ray actors), with
    TrainerConfig's defaults."""

    clip_low: float = _default("clip_low")
    clip_high: float = _default("clip_high")
    dual_clip: float | None = _default("dual_clip")
    kl_coef: float = _default("kl_coef")
    entropy_coef: float = _default("entropy_coef")
    bf16_autocast: bool = _default("bf16_autocast")
    dtype: str = _default("dtype")
    logprob_chunk: int = _default("logprob_chunk")
    loss_agg: str = _default("loss_agg")
    loss_norm_tokens: int = _default("loss_norm_tokens")
    tis_clip: float = _default("tis_clip")
    micro_batch_size: int = _default("micro_batch_size")
    max_tokens_per_micro_batch: int = _default("max_tokens_per_micro_batch")
    pack_rows: bool = _default("pack_rows")
    share_prefix: bool = _default("share_prefix")
    grad_clip: float = _default("grad_clip")
    lr: float = _default("lr")
    weight_decay: float = _default("weight_decay")
    adam_betas: tuple[float, float] = _default("adam_betas")
    optimizer_state: str = "fp32"  # resolved: TrainerConfig's "auto" is --memory's to decide
    activation_checkpointing: bool = _default("activation_checkpointing")
    mlp_chunk: int = _default("mlp_chunk")
    layer_chunk: int = _default("layer_chunk")
    lora_rank: int = _default("lora_rank")
    lora_alpha: float = _default("lora_alpha")
    lora_target_modules: tuple[str, ...] = _default("lora_target_modules")
    heap: str = _default("heap")

    @classmethod
    def from_config(cls, config: TrainerConfig) -> StepSettings:
        values = {k: getattr(config, k) for k in cls.__dataclass_fields__}
        # packed only where the model's attention allows it: every process (a sharded rank,
        # the driver counting their passes) then counts a pass's cost the same way
        values["pack_rows"] = config.pack_rows and packing.model_dir_supported(config.model_dir)
        plan = memory.plan_for(
            config.memory, lora_rank=config.lora_rank, model_dir=config.model_dir
        )
        return cls(**memory.step_values(values, plan, dtype=config.dtype, parallel=config.parallel))


@dataclass(frozen=True)
class Totals:
    """Whole-batch normalisers: model tokens and rows with at least one model token."""

    tokens: float
    seqs: float

    @classmethod
    def of(cls, batch: Batch) -> Totals:
        shifted = batch.loss_mask[:, 1:]
        return cls(float(shifted.sum()), float((shifted.sum(-1) > 0).sum()))


@dataclass
class StepStats:
    loss: float = 0.0
    kl: float = 0.0  # mean k3 KL to the reference per model token (0 when kl_coef is 0)
    clip_frac: float = 0.0
    entropy: float = 0.0
    ratio_mean: float = 0.0
    grad_norm: float = 0.0
    rows: int = 0
    model_tokens: int = 0
    tokens: int = 0  # every real token processed, prompts included

    @classmethod
    def from_sums(cls, loss: float, sums: LossSums, grad_norm: float, batch: Batch) -> StepStats:
        n = max(sums.tokens, 1.0)
        return cls(
            loss=loss,
            kl=sums.kl / n,
            clip_frac=sums.clipped / n,
            entropy=sums.entropy / n,
            ratio_mean=sums.ratio / n,
            grad_norm=grad_norm,
            rows=batch.rows,
            model_tokens=int(sums.tokens),
            tokens=batch.tokens,
        )

    def to_dict(self) -> dict:
        return asdict(self)


def load_model(
    model_dir: str | Path,
    device: str | torch.device,
    *,
    trainable: bool = True,
    dtype: str = "float32",
):
    """The model of ``model_dir`` in ``dtype`` (fp32, or fp64 for numerical checks) on
    ``device``; on ``"meta"`` its shapes alone, from its config (nothing read: a sharded rank
    fills them from rank 0, trainer/fsdp.py)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a per-load progress bar is noise in service logs
    if str(device) == "meta":
        with torch.device("meta"):
            config = AutoConfig.from_pretrained(str(model_dir))
            model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, dtype))
        model.to(device)  # type: ignore[arg-type]  # transformers' stubs type .to() as a PreTrainedModel method
    if trainable:
        model.train()
    else:
        model.eval()
        model.requires_grad_(False)
    return model


def _packing(model, settings: StepSettings):
    """``model`` set up for packed rows when ``pack_rows`` asks (``from_config`` asks only
    where the model's config allows it)."""
    if not settings.pack_rows:
        return model
    config = getattr(model, "config", None)
    if config is not None and not packing.plain_causal(config):
        return model  # a sliding window or a soft cap: such a model runs padded
    if not packing.supported(model):
        raise TrainerConfigError(
            f"{type(model).__name__} cannot take packed rows (its attention does not go "
            "through transformers' attention interface, or is more than causal attention "
            "within a row): train it with --no-pack-rows"
        )
    packing.enable(model)
    return model


def load_reference(model_dir: str | Path, device: str | torch.device, settings: StepSettings):
    """The frozen reference model (the KL term's), run as the policy is (packed or not)."""
    return _packing(load_model(model_dir, device, trainable=False, dtype=settings.dtype), settings)


def load_policy(model_dir: str | Path, device: str | torch.device, settings: StepSettings):
    """The model trained: the base, set up for packed rows (``pack_rows``) and activation
    checkpointing (``activation_checkpointing``), its feed-forward blocks run ``mlp_chunk``
    positions at a time (trainer/chunked_mlp.py), wrapped with LoRA adapters when
    ``lora_rank`` > 0."""
    model = _packing(load_model(model_dir, device, dtype=settings.dtype), settings)
    # the embedding's and every Linear's weight gradients added into .grad (trainer/fused_grads.py)
    fuse_embedding(model)
    fuse_linears(model)
    if settings.activation_checkpointing:
        non_reentrant = {"use_reentrant": False}
        if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x's name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=non_reentrant)
        else:  # gradient_checkpointing_enable: deprecated in 5.x, gone in v6
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=non_reentrant)
        # a long pass's layers, a slice of positions at a time (trainer/sliced_layers.py)
        release = heap.release if settings.heap == "release" else None
        slice_layers(model, settings.layer_chunk, release)
    # a long row's feed-forward activations, a slice at a time (trainer/chunked_mlp.py)
    chunk_feed_forward(model, settings.mlp_chunk)
    if settings.lora_rank > 0:
        from .lora import with_lora

        model = with_lora(
            model,
            rank=settings.lora_rank,
            alpha=settings.lora_alpha,
            target_modules=settings.lora_target_modules,
        )
    return model


def publishable(model, settings: StepSettings):
    """What a publisher receives of the live model: the model, or with LoRA its adapter."""
    if settings.lora_rank > 0:
        from .lora import AdapterExport

        return AdapterExport(model)
    return model


def head_chunk(settings: StepSettings, mb: Batch) -> int:
    """The log-prob chunk of pass ``mb``: ``logprob_chunk``, but at most
    ``memory.LONG_PASS_CHUNK`` in a pass of more real tokens than ``layer_chunk``, whose layers
    run sliced (trainer/sliced_layers.py): such a pass still holds its layers' inputs (hundreds
    of MiB at 8,192 positions) when the head's backward makes its (chunk, V) tensors."""
    chunk = settings.logprob_chunk
    long_pass = settings.layer_chunk > 0 and int(mb.attention_mask.sum()) > settings.layer_chunk
    return min(chunk, memory.LONG_PASS_CHUNK) if long_pass and chunk > 0 else chunk


def forward_backward(
    model,
    ref_model,
    batch: Batch,
    settings: StepSettings,
    totals: Totals,
    device: str | torch.device,
    micro_batches: Iterable[Batch] | None = None,
) -> tuple[float, LossSums]:
    """Accumulate this batch's (or shard's) gradient; returns its share of the loss.
    ``micro_batches``: the passes to run, when the caller decides them (a sharded rank runs
    as many as every other rank, trainer/fsdp.py); by default ``micro_batch_size`` rows and
    ``max_tokens_per_micro_batch`` tokens at most each."""
    loss_total, sums = 0.0, LossSums()
    if micro_batches is None and batch.rows == 0:
        return loss_total, sums
    if micro_batches is None:  # a pass's cost as the model runs it, packed or padded
        micro_batches = batch.micro_batches(
            settings.micro_batch_size,
            max_tokens=settings.max_tokens_per_micro_batch,
            packed=packing.enabled(causal_lm(model)),
            share_prefix=settings.share_prefix,
        )
    for micro in micro_batches:
        mb = micro.to(device)
        ref = None
        if ref_model is not None and settings.kl_coef > 0:
            with torch.no_grad():
                ref = token_stats(
                    ref_model,
                    mb,
                    chunk=head_chunk(settings, mb),
                    entropy=False,
                    bf16_autocast=settings.bf16_autocast,
                    share_prefix=settings.share_prefix,
                ).logprobs  # (b, T-1)
        pass_loss = _PassLoss(mb, ref, settings, totals)
        # Log-probs at the loss's positions only, `logprob_chunk` positions at a time, the head
        # in fp32 even under bf16 autocast (trainer/logprobs.py; 0: the whole-vocabulary path).
        # Given the loss, the head makes its gradient while it holds each chunk's logits.
        stats = token_stats(
            model,
            mb,
            chunk=head_chunk(settings, mb),
            entropy_grad=settings.entropy_coef > 0,
            bf16_autocast=settings.bf16_autocast,
            share_prefix=settings.share_prefix,
            loss=pass_loss.value,
        )
        loss, part = pass_loss(stats.logprobs, stats.entropy)
        mask = mb.loss_mask[:, 1:]  # (b, T-1): position t predicts token t + 1
        assert stats.entropy is not None
        part.entropy = float(stats.entropy.detach()[mask].sum())
        loss.backward()
        loss_total += float(loss.detach())
        sums += part
        del stats, loss, ref, pass_loss, mb
        if settings.heap == "release":
            heap.release()  # this pass's activations, back to the system (trainer/heap.py)
    return loss_total, sums


class _PassLoss:
    """One pass's GRPO loss as a function of its (b, T-1) log-probs and entropies, each
    position's term reading only its own values: what ``forward_backward`` takes of the
    policy's, and what the head differentiates a chunk at a time (``logprobs.LossGrads``)."""

    def __init__(
        self, mb: Batch, ref: torch.Tensor | None, settings: StepSettings, totals: Totals
    ) -> None:
        self.mb, self.ref, self.settings, self.totals = mb, ref, settings, totals
        self.tis = mb.tis[:, 1:]  # (b, T-1): too-stale tokens, each by its own version
        self.any_tis = bool(self.tis.any())

    def __call__(
        self, logprobs: torch.Tensor, entropy: torch.Tensor | None, sums: bool = True
    ) -> tuple[torch.Tensor, LossSums]:
        mb, settings = self.mb, self.settings
        behaviour = mb.old_logprobs[:, 1:]  # (b, T-1)
        # Too-stale tokens (stale_policy tis): ratio against the current policy, weighted by
        # min(pi_current / pi_rollout, tis_clip); see trainer/grpo.py.
        old = torch.where(self.tis, logprobs.detach(), behaviour)  # (b, T-1)
        is_weights = None
        if self.any_tis:
            w = truncated_is_weights(logprobs.detach(), behaviour, clip=settings.tis_clip)
            is_weights = torch.where(self.tis, w, torch.ones_like(w))  # (b, T-1)
        return grpo_loss(
            logprobs,
            old,
            mb.advantages[:, 1:],
            mb.loss_mask[:, 1:],
            clip_low=settings.clip_low,
            clip_high=settings.clip_high,
            dual_clip=settings.dual_clip,
            mode=settings.loss_agg,
            is_weights=is_weights,
            ref_logprobs=self.ref,
            kl_coef=settings.kl_coef,
            entropy=entropy if settings.entropy_coef > 0 else None,  # with gradient
            entropy_coef=settings.entropy_coef,
            total_tokens=self.totals.tokens,
            total_seqs=self.totals.seqs,
            norm_tokens=settings.loss_norm_tokens,
            sums=sums,
        )

    def value(self, logprobs: torch.Tensor, entropy: torch.Tensor | None) -> torch.Tensor:
        """The loss alone (what the head differentiates a chunk at a time)."""
        return self(logprobs, entropy, sums=False)[0]


def make_optimizer(model, settings: StepSettings) -> torch.optim.Optimizer:
    """AdamW over the trained parameters, its moments kept as ``optimizer_state`` says (fp8:
    each gradient dropped once its update is taken; ``apply_update`` zeroes them all after the
    step in any case)."""
    params = [p for p in model.parameters() if p.requires_grad]
    betas = (settings.adam_betas[0], settings.adam_betas[1])
    if settings.optimizer_state == "fp8":
        return Fp8AdamW(
            params, lr=settings.lr, betas=betas, weight_decay=settings.weight_decay,
            release_grads=True,
        )  # fmt: skip
    return torch.optim.AdamW(
        params, lr=settings.lr, betas=betas, weight_decay=settings.weight_decay
    )


def check_moments(state: dict, settings: StepSettings) -> None:
    """Refuse, naming the flag, an optimizer state saved with the other ``--optimizer-state``."""
    saved = moments_of(state)
    if saved != settings.optimizer_state:
        raise TrainerConfigError(
            f"the checkpoint's optimizer state keeps {saved} moments and this trainer keeps "
            f"{settings.optimizer_state} ones: resume it with --optimizer-state {saved}"
        )


def apply_update(
    model, optimizer: torch.optim.Optimizer, grad_clip: float, *, release_heap: bool = False
) -> float:
    """Clip the accumulated gradient (if grad_clip > 0), step, zero; returns the grad norm.
    ``release_heap``: the freed gradients' memory back to the system (trainer/heap.py)."""
    params = [p for p in model.parameters() if p.grad is not None]
    if grad_clip > 0:
        norm = _scalar(torch.nn.utils.clip_grad_norm_(params, grad_clip))
    elif params and hasattr(params[0].grad, "full_tensor"):  # sharded (DTensor) gradients
        norm = _scalar(torch.nn.utils.get_total_norm([p.grad for p in params]))
    else:
        norm = math.sqrt(sum(float(p.grad.detach().pow(2).sum()) for p in params))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if release_heap:
        heap.release()
    return norm


def memory_of(model, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """Bytes held in this process by the model's parameters and the optimizer's state (a
    sharded rank's: its shards only). AdamW's moments exist from the first step on."""
    return {
        "params": sum(_nbytes(p) for p in model.parameters()),
        "optimizer": sum(
            _nbytes(v)
            for state in optimizer.state.values()
            for v in state.values()
            if isinstance(v, torch.Tensor)
        ),
    }


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds in this process: a sharded (DTensor) one, its local shard's."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _scalar(norm: torch.Tensor) -> float:
    """A norm as a float; a sharded trainer's is a DTensor, reduced over the ranks first."""
    full = getattr(norm, "full_tensor", None)
    return float(full() if callable(full) else norm)


class LocalUpdater:
    """Model, frozen reference and optimizer in this process (``--ray-workers 0``)."""

    def __init__(self, config: TrainerConfig) -> None:
        self.settings = StepSettings.from_config(config)
        self.device = torch.device(config.device)
        self.model = load_policy(config.model_dir, self.device, self.settings)
        self.ref_model = (
            load_reference(config.model_dir, self.device, self.settings)
            if config.kl_coef > 0
            else None
        )
        self.optimizer = make_optimizer(self.model, self.settings)

    def step(self, batch: Batch, seed: int) -> StepStats:
        torch.manual_seed(seed)
        self.optimizer.zero_grad(set_to_none=True)
        loss, sums = forward_backward(
            self.model, self.ref_model, batch, self.settings, Totals.of(batch), self.device
        )
        grad_norm = apply_update(
            self.model,
            self.optimizer,
            self.settings.grad_clip,
            release_heap=self.settings.heap == "release",
        )
        return StepStats.from_sums(loss, sums, grad_norm, batch)

    def state(self) -> tuple[dict, dict]:
        return self.model.state_dict(), self.optimizer.state_dict()

    def load_state(self, model_state: dict, optimizer_state: dict) -> None:
        check_moments(optimizer_state, self.settings)
        self.model.load_state_dict(model_state)
        self.optimizer.load_state_dict(optimizer_state)

    def write_checkpoint(self, directory: Path) -> None:
        """The weights of a checkpoint being written into ``directory`` (trainer/checkpoint.py)."""
        write_full(directory, *self.state())

    def read_checkpoint(self, loaded: Loaded) -> None:
        self.load_state(*loaded.full_states())

    def publishable_model(self):
        """The model to hand to a WeightPublisher (this process holds the live one)."""
        return publishable(self.model, self.settings)

    def close(self) -> None:
        pass
