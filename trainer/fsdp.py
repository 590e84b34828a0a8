"""Sharded data parallel (``--parallel fsdp``): FSDP2 on N Ray actors, each holding 1/N.

The replicated trainer (trainer/ray_dp.py) keeps the whole model, reference and AdamW state on
every rank: about 16 bytes a parameter in fp32 with Adam, so a rank must hold the whole model
several times over. Here each rank holds a shard: the policy (and the frozen reference, when
``kl_coef`` > 0) is wrapped with PyTorch's ``fully_shard`` (FSDP2) per decoder layer and once
on the whole model, on a one-dimensional device mesh of the N ranks, so parameters, gradients
and AdamW's moments are split along their first dimension; a layer's parameters are gathered
for its forward and backward and freed after (``reshard_after_forward``), and gradients are
reduce-scattered. Per rank that is about 1/N of the replicated rank's parameter and optimizer
memory (measured in tests/test_fsdp.py and bench/fsdp_memory.py).

The update is the replicated trainer's, exactly: the driver splits the batch into N contiguous
shards, every rank's loss is normalised by the *whole* batch's counts (``step.Totals``), and the
reduce-scatter sums (the gradient divide factor is set to 1, where FSDP would average), so N
ranks compute the update of one. Every rank runs the same number of forward passes (FSDP's
collectives must pair up): a rank with fewer rows, or none, runs idle passes on a one-row
batch with no loss token, which add nothing.

Devices: gloo on CPU (fp32 throughout); nccl on CUDA, one GPU per actor, where ``--bf16`` is
FSDP's ``MixedPrecisionPolicy`` (bf16 parameters for compute, fp32 gradient reduction, fp32
master weights and AdamW state). ``--activation-checkpointing`` recomputes each decoder layer's
activations in the backward pass (transformers' gradient checkpointing, non-reentrant).

Checkpoints are sharded: every rank writes its shards with ``torch.distributed.checkpoint``
into the checkpoint's ``shards/`` directory (a directory all ranks see: one machine, or a
shared filesystem) and reads them back on resume. Publishing gathers **one parameter at a
time**: each is all-gathered across the ranks (``DTensor.full_tensor``), rank 0 sends it to the
driver, which copies it into its CPU mirror model, and it is freed before the next; no rank
ever holds a second full copy of the model, and the publishers (object store, shared path,
stream) receive the mirror as they receive any model.
"""

from __future__ import annotations

from pathlib import Path

import torch

from .batch import Batch, Row, collate
from .checkpoint import SHARDS, Loaded
from .errors import CheckpointError
from .grpo import LossSums
from .ray_dp import RayDataParallel, _Worker
from .step import (
    StepSettings,
    Totals,
    apply_update,
    forward_backward,
    load_policy,
    load_reference,
    make_optimizer,
    publishable,
)


def decoder_layers(model) -> list[torch.nn.Module]:
    """The model's repeated blocks, each its own FSDP unit: the classes transformers names in
    ``_no_split_modules`` (Qwen2DecoderLayer, LlamaDecoderLayer, ...), else any module whose
    class name ends in DecoderLayer."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [
        m
        for m in model.modules()
        if type(m).__name__ in names or (not names and type(m).__name__.endswith("DecoderLayer"))
    ]


def shard_model(model, mesh, *, mixed_precision: bool) -> None:
    """``fully_shard`` per decoder layer, then on the whole model; gradients summed, not
    averaged, over the ranks (the loss is already normalised by the whole batch)."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed_precision
        else MixedPrecisionPolicy()
    )
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM


def idle_pass() -> Batch:
    """A one-row pass with no loss token: what a rank short of rows runs so every rank's
    collectives pair up (it adds nothing to the loss or the gradient)."""
    row = Row(
        input_ids=[0, 0],
        loss_mask=[0, 0],
        old_logprobs=[0.0, 0.0],
        temperature=[1.0, 1.0],
        advantage=0.0,
        tis=[0, 0],
        job_id="",
    )
    return collate([row], pad_id=0)


def passes_of(shard: Batch, settings: StepSettings) -> list[Batch]:
    if not shard.rows:
        return []
    return list(
        shard.micro_batches(
            settings.micro_batch_size,
            max_tokens=settings.max_tokens_per_micro_batch,
            packed=settings.pack_rows,
            share_prefix=settings.share_prefix,
        )
    )


class _FsdpWorker(_Worker):
    """One sharded rank (wrapped with ray.remote at start-up). Rank 0 reads the model
    directory; every other rank builds the model on the meta device (no memory), and once the
    process group exists (``setup``) each shards its model, the others allocate their shards
    only, and rank 0 broadcasts the weights into them (``set_model_state_dict`` with
    ``broadcast_from_rank0``; buffers, which are not sharded, by plain broadcasts). So only
    rank 0 ever holds a whole copy, for the time of the load."""

    def __init__(self, rank: int, world: int, model_dir: str, settings: StepSettings, device: str):
        torch.set_num_threads(1 if device == "cpu" else torch.get_num_threads())
        self.rank, self.world = rank, world
        self.settings = settings
        self.device = torch.device(device)
        where = "cpu" if rank == 0 else "meta"
        self.model = load_policy(model_dir, where, settings)
        self.ref_model = (
            load_reference(model_dir, where, settings) if settings.kl_coef > 0 else None
        )

    def setup(self, host: str, port: int) -> bool:
        from torch.distributed.device_mesh import init_device_mesh

        super().setup(host, port)
        mesh = init_device_mesh(self.device.type, (self.world,))
        mixed = self.device.type == "cuda" and self.settings.bf16_autocast
        for model in (self.model, self.ref_model):
            if model is not None:
                self._shard(model, mesh, mixed)
        self.optimizer = make_optimizer(self.model, self.settings)  # over the shards
        return True

    def _shard(self, model, mesh, mixed: bool) -> None:
        import torch.distributed as dist
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )

        whole = model.state_dict() if self.rank == 0 else {}  # rank 0's tensors, kept alive
        shard_model(model, mesh, mixed_precision=mixed)
        if self.rank != 0:
            model.to_empty(device=self.device)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, whole, options=options)
        with torch.no_grad():
            for buffer in model.buffers():  # rotary tables and the like: not in every state dict
                dist.broadcast(buffer, src=0)
        whole.clear()

    def step(
        self, shard: Batch, totals: Totals, seed: int, passes: int = 1
    ) -> tuple[float, LossSums, float]:
        torch.manual_seed(seed)
        self.optimizer.zero_grad(set_to_none=True)
        micro = passes_of(shard, self.settings)
        micro += [idle_pass()] * (passes - len(micro))
        loss, sums = forward_backward(
            self.model,
            self.ref_model,
            shard,
            self.settings,
            totals,
            self.device,
            micro_batches=micro,
        )
        grad_norm = apply_update(
            self.model,
            self.optimizer,
            self.settings.grad_clip,
            release_heap=self.settings.heap == "release",
        )
        return loss, sums, grad_norm

    def gather(self, name: str) -> torch.Tensor | None:
        """Parameter ``name`` whole (a collective: every rank calls it), to rank 0's caller."""
        param = self.model.get_parameter(name)
        full = param.full_tensor() if hasattr(param, "full_tensor") else param
        return full.detach().cpu() if self.rank == 0 else None

    def save_shards(self, directory: str) -> bool:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory)
        return True

    def load_shards(self, directory: str) -> bool:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        # read in place into these tensors (this rank's shards)
        dcp.load({"model": model_state, "optim": optimizer_state}, checkpoint_id=directory)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=model_state,
            optim_state_dict=optimizer_state,
        )
        return True


class FsdpParallel(RayDataParallel):
    """The updater interface over ``world`` sharded ranks (the module docstring)."""

    worker = _FsdpWorker

    def __repr__(self) -> str:
        return f"<FsdpParallel world={self.world} device={self.config.device}>"

    def _step_args(self, shards: list[Batch]) -> tuple:
        return (max(1, *(len(passes_of(s, self.settings)) for s in shards)),)

    def publishable_model(self):
        """The driver's CPU mirror with the ranks' current weights, one parameter at a time
        (with LoRA the adapters' alone: the frozen base is the model directory's)."""
        lora = self.settings.lora_rank > 0
        with torch.no_grad():
            for name, param in self.mirror().named_parameters():
                if lora and "lora_" not in name:
                    continue
                calls = [a.gather.remote(name) for a in self.actors]  # type: ignore[attr-defined,union-attr]
                param.copy_(self._get(calls, "gathering weights")[0])
        return publishable(self.mirror(), self.settings)

    def state(self) -> tuple[dict, dict]:
        raise CheckpointError(
            "a sharded trainer has no whole state in one place: its checkpoints are sharded "
            "(write_checkpoint)"
        )

    def write_checkpoint(self, directory: Path) -> None:
        target = str(directory / SHARDS)
        self._get([a.save_shards.remote(target) for a in self.actors], "saving shards")  # type: ignore[attr-defined,union-attr]

    def read_checkpoint(self, loaded: Loaded) -> None:
        if not loaded.sharded:
            raise CheckpointError(
                f"checkpoint {loaded.path} was written by a replicated trainer: resume it "
                "without --parallel fsdp (or start a new checkpoint directory)"
            )
        source = str(loaded.path / SHARDS)
        self._get([a.load_shards.remote(source) for a in self.actors], "loading shards")  # type: ignore[attr-defined,union-attr]
