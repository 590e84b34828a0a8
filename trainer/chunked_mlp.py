"""A decoder layer's feed-forward block run ``chunk`` positions at a time, each chunk
recomputed in the backward pass (``--mlp-chunk``; ``--memory small`` sets it).

Under activation checkpointing a layer keeps only its input; the backward pass runs the layer
again and keeps all of its activations for the time of that layer's backward (without
checkpointing, every layer's, from the forward pass on). For a long row those are mostly the
feed-forward block's: gate, up, the activation and their product, four
(T, I) tensors (I = 1,536 for SmolLM2, 2.7 times the width): 200 MB at 8,192 positions, and
as much again for their gradients. The block is position-wise (each position's output is a
function of that position's input alone), so running it on slices of the positions and joining
the outputs gives the same values, and gradients that are the same sums in another order of
additions (``tests/test_memory_plan.py``). Each slice is itself checkpointed, so a layer's
backward holds one slice's activations at a time; without gradients the slices simply run in
turn.

Only dense feed-forward blocks: a mixture of experts routes and balances over all of a pass's
positions at once (its load-balancing loss is not position-wise), so ``enable`` leaves a block
whose class names experts (``Moe``, ``Sparse``, ``Expert``) alone, and every block whose
``forward`` returns anything but one tensor of its input's shape runs whole. A pass of
``chunk`` positions or fewer runs as the block always did.

Under ``--layer-chunk`` (trainer/sliced_layers.py: ``--memory small`` sets both to 512) a long
pass's whole layers run sliced, so the block sees one layer slice at a time and slices further
only where ``--mlp-chunk`` is the smaller; the blocks of a layer that cannot run sliced are
still sliced here.
"""

from __future__ import annotations

import functools
import types

import torch
from torch.utils.checkpoint import checkpoint

_EXPERTS = ("moe", "sparse", "expert")


def feed_forward_blocks(model) -> list[torch.nn.Module]:  # type: ignore[no-untyped-def]
    """The dense feed-forward blocks of ``model``'s decoder layers (``layers[i].mlp``)."""
    blocks = []
    for name, module in model.named_modules():
        if not name.endswith(".mlp"):
            continue
        kind = type(module).__name__.lower()
        if any(word in kind for word in _EXPERTS):
            continue
        blocks.append(module)
    return blocks


def _chunked(block: torch.nn.Module, hidden: torch.Tensor, *args, chunk: int, **kwargs):  # type: ignore[no-untyped-def]
    """``block``'s forward: its class's own on ``chunk`` positions at a time where a pass has
    more, each slice checkpointed where the pass has gradients."""
    whole = functools.partial(type(block).forward, block)  # the block's own, a copy's its own
    positions = hidden.shape[-2] if hidden.dim() >= 2 else 0
    if args or kwargs or positions <= chunk:
        return whole(hidden, *args, **kwargs)
    run = whole  # without gradients there is nothing to keep: the slices one after another
    if torch.is_grad_enabled():
        run = functools.partial(checkpoint, whole, use_reentrant=False)
    parts = []
    for start in range(0, positions, chunk):
        part = run(hidden[..., start : start + chunk, :])
        if not isinstance(part, torch.Tensor) or part.shape[-2] != min(chunk, positions - start):
            return whole(hidden)  # not a position-wise block after all: run it whole
        parts.append(part)
    return torch.cat(parts, dim=-2)


def enable(model, chunk: int) -> int:  # type: ignore[no-untyped-def]
    """Run ``model``'s dense feed-forward blocks ``chunk`` positions at a time when a pass has
    more; returns how many blocks now do. ``chunk`` 0: nothing changes. Idempotent: a block
    already set up is set to the new ``chunk``."""
    if chunk <= 0:
        return 0
    blocks = feed_forward_blocks(model)
    for block in blocks:
        # an instance attribute: the module's class, parameters and names stay as they were
        block.forward = types.MethodType(functools.partial(_chunked, chunk=chunk), block)
    return len(blocks)
