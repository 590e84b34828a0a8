"""Weight gradients added straight into ``.grad`` as they are computed (what Megatron calls
gradient accumulation fusion): the embedding's and the head's, the two (V, H) weights, and
every other plain ``Linear``'s (``LinearIntoGrad``).

Every pass makes the input embedding's gradient as a dense (V, H) tensor at the end of the
backward pass, and the head's (trainer/logprobs.py, ``HeadStats``) at its start; where the two
share one weight (SmolLM2, Qwen2.5's small models, Llama 3.2 1B and 3B), autograd holds the
head's contribution through the whole backward pass until the embedding's arrives, sums them,
and adds the sum into ``.grad``: three (V, H) tensors at once, 113 MB each for SmolLM2, at the
step's peak (docs/benchmarks.md, "The defaults"). Added into ``weight.grad`` where they are
computed, neither is held, and autograd is handed nothing for the weight.

A plain ``Linear``'s weight gradient is an (out, in) matrix product a pass that autograd
makes as a tensor of its own and then adds into ``.grad``; with ``LinearIntoGrad`` the product
is added there by ``addmm_`` itself. For SmolLM2's step of 16 passes those additions read and
wrote every layer's gradient 16 times: about half a second of a 50 s step (``aten::add_``,
profiled).

Only where nothing else reads the weight's gradient on its way (``fusable``): a plain leaf
parameter that is trained, no post-accumulate-grad hooks, the model not sharded by FSDP2
(whose hooks reduce-scatter the gradients); elsewhere autograd's own path runs. The gradient is
the same sum in another order of additions (fp32 rounding; tests/test_logprob_chunks.py).
"""

from __future__ import annotations

import weakref
from typing import cast

import torch


def fusable(weight: torch.Tensor, model) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``weight``'s gradient may be added into ``weight.grad`` directly in ``model``."""
    if not (torch.is_grad_enabled() and weight.requires_grad and weight.is_leaf):
        return False
    if type(weight) not in (torch.Tensor, torch.nn.Parameter):  # a DTensor, a subclass
        return False
    if getattr(weight, "_post_accumulate_grad_hooks", None):
        return False
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without distributed: nothing can shard the model
        return True
    return not isinstance(model, FSDPModule)


def grad_of(weight: torch.Tensor) -> torch.Tensor:
    """``weight.grad``, made (zeros) first where there is none yet."""
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return weight.grad


class EmbeddingIntoGrad(torch.autograd.Function):
    """``nn.Embedding``'s lookup (no max_norm, dense), its weight gradient added into
    ``weight.grad`` row by row (``index_add_``) instead of returned as a dense (V, H) tensor;
    ``padding_idx``'s row gets none, as ``F.embedding``'s."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx):  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(ids)
        ctx.weight, ctx.padding_idx = weight, padding_idx
        return torch.nn.functional.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def,override]
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        flat_ids = ids.reshape(-1)
        rows = grad_out.reshape(-1, weight.shape[1]).to(weight.dtype)
        if ctx.padding_idx is not None:
            rows = rows.masked_fill((flat_ids == ctx.padding_idx).unsqueeze(-1), 0)
        grad_of(weight).index_add_(0, flat_ids, rows)
        return None, None, None


class FusedEmbedding(torch.nn.Embedding):
    """An ``nn.Embedding`` whose lookup adds its weight gradient into ``.grad``
    (``EmbeddingIntoGrad``) whenever ``fusable`` holds for the model it was set in."""

    _root: weakref.ref

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        model = self._root()
        if model is not None and fusable(self.weight, model):
            return EmbeddingIntoGrad.apply(ids, self.weight, self.padding_idx)
        return super().forward(ids)


def fuse_embedding(model) -> bool:  # type: ignore[no-untyped-def]
    """Make ``model``'s input embedding, a plain ``nn.Embedding``, a ``FusedEmbedding`` (the
    same module, weight and state dict); False where it is not one."""
    embedding = model.get_input_embeddings()
    if type(embedding) is not torch.nn.Embedding or embedding.max_norm is not None:
        return False
    if embedding.sparse or embedding.scale_grad_by_freq:
        return False
    embedding.__class__ = FusedEmbedding
    fused = cast(FusedEmbedding, embedding)
    fused._root = weakref.ref(model)
    return True


class LinearIntoGrad(torch.autograd.Function):
    """``F.linear``, its weight's (and bias's) gradient added into ``.grad`` in the backward
    pass (``addmm_``) instead of returned; the input's gradient as autograd's linear makes it."""

    @staticmethod
    def forward(ctx, x, weight, bias):  # type: ignore[no-untyped-def,override]
        ctx.save_for_backward(x)
        # the parameters themselves, not saved tensors: under activation checkpointing a saved
        # tensor comes back as another tensor object, whose .grad is not the parameter's
        ctx.weight, ctx.bias = weight, bias
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):  # type: ignore[no-untyped-def,override]
        (x,) = ctx.saved_tensors
        weight = ctx.weight
        grad_x = grad_out.matmul(weight) if ctx.needs_input_grad[0] else None
        rows = grad_out.reshape(-1, grad_out.shape[-1])  # (positions, out)
        grad_of(weight).addmm_(rows.t(), x.reshape(-1, x.shape[-1]))
        if ctx.bias is not None:
            grad_of(ctx.bias).add_(rows.sum(0))
        return grad_x, None, None


class FusedLinear(torch.nn.Linear):
    """An ``nn.Linear`` whose weight (and bias) gradient goes into ``.grad``
    (``LinearIntoGrad``) whenever ``fusable`` holds for both in the model it was set in and
    autocast is off (under autocast, and elsewhere, ``nn.Linear``'s own forward)."""

    _root: weakref.ref

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        model = self._root()
        if (
            model is not None
            and fusable(self.weight, model)
            and (self.bias is None or fusable(self.bias, model))
            and not torch.is_autocast_enabled(x.device.type)
        ):
            return LinearIntoGrad.apply(x, self.weight, self.bias)
        return super().forward(x)


def fuse_linears(model) -> int:  # type: ignore[no-untyped-def]
    """Make every plain ``nn.Linear`` of ``model`` but its output head (trainer/logprobs.py
    adds the head's gradient itself) a ``FusedLinear`` (the same module, weights and state
    dict); returns how many. Call it before adapters wrap the layers (LoRA's frozen base
    layers are not ``fusable``: they run as ``nn.Linear``)."""
    head = (
        model.get_output_embeddings()
        if callable(getattr(model, "get_output_embeddings", None))
        else None
    )
    count = 0
    for module in model.modules():
        if type(module) is not torch.nn.Linear or module is head:
            continue
        module.__class__ = FusedLinear
        cast(FusedLinear, module)._root = weakref.ref(model)
        count += 1
    return count
