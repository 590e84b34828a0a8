"""A long pass's decoder layers run a slice of positions at a time, every second layer's input
kept (``--layer-chunk``; ``--memory small`` sets it).

Under activation checkpointing (``torch.utils.checkpoint``) a layer keeps its input for the
backward pass, and its backward runs the whole layer again over every position of the pass,
keeping all of that layer's activations at once. For one long row that second part sets the
step's peak: SmolLM2's layer at 8,192 positions peaks 464 MiB above its start
(bench/sliced_layer.py; the normalised input, the queries, keys and values, the attention's
output and the projections' inputs, each (T, 576) or a third of it, and their gradients)
beside the gradients of the whole model, and the 30 kept inputs are 540 MiB
more (docs/benchmarks.md, "Where the 8,192-token row's peak is").

Here a layer of a pass longer than ``chunk`` positions is one autograd node that keeps its
input alone, and whose forward and backward run the layer's own ``forward`` on ``chunk``
positions at a time:

1. the keys and values of every position, computed slice by slice without a graph: the layer
   runs up to its attention, which hands them over (``packing.capture_keys``) and stops it;
2. each slice of queries runs the whole layer again, its attention reading those keys and
   values (``packing.slice_queries``: the causal rows of the pass, as the whole pass's
   attention sees them); in the backward pass each slice's graph is built, run backward with
   the slice's output gradient and dropped, adding into the weights' gradients and into the
   keys' and values' gradients;
3. (backward only) each slice runs up to its attention again, with a graph, and its keys and
   values are run backward with their accumulated gradients: the keys' and values'
   projections' part of the weights' and the input's gradients.

So a layer's backward holds one slice's activations, the pass's keys and values and their
gradients (four (T, kv_heads * head_dim) tensors: 25 MB at 8,192 positions for SmolLM2), and
its input and output gradients: 83 MiB above its start (bench/sliced_layer.py). The values
are the whole layer's (each position meets the same weights and keys); the gradients are
the same sums in another order of additions (tests/test_sliced_layers.py). The cost is in
long passes only: the queries', keys' and values' projections run twice more (a layer's
backward took 16.7 s against plain checkpointing's 13.4 s, median of five alternated rounds,
bench/sliced_layer.py), and every second layer's forward once more.

**Every second layer's input** (``LAYERS_PER_CHECKPOINT``): the layer after a kept input keeps
nothing. Its backward first runs the layer before it again (sliced, without a graph) from that
layer's kept input: 15 inputs held for SmolLM2 instead of 30, 270 MiB at 8,192 positions.

Only where it is exact: the layers get the packed rows' boundaries (``packing``'s attention,
plain causal), no attention mask, no cache, no dropout, no experts (whose routing balances
over all of a pass's positions), and each returns one tensor of its input's shape; a layer
whose input has no gradient runs under plain checkpointing (its backward would never run: the
weights' gradients are added in it). Anything else runs as plain checkpointing runs it.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from . import packing

LAYERS_PER_CHECKPOINT = 2  # a kept input every second layer (the module docstring)
_EXPERTS = ("moe", "sparse", "expert")
# keyword arguments a decoder layer receives whose tensors run along the pass's positions
_BY_POSITION = ("position_ids", "position_embeddings", "cache_position")
# keyword arguments the packed forward passes down to the attention (trainer/packing.py)
_PASSED = (
    "cu_seq_lens_q",
    "cu_seq_lens_k",
    "max_length_q",
    "max_length_k",
    "packed_row_edges",
    "packed_prefixes",
)


class _NotSliceable(Exception):
    """This layer's call cannot run sliced: plain checkpointing runs it instead."""


def _slice_value(value, start: int, stop: int, positions: int):  # type: ignore[no-untyped-def]
    """``value`` (a keyword argument along the positions) at ``start:stop``."""
    if isinstance(value, tuple):
        return tuple(_slice_value(v, start, stop, positions) for v in value)
    if not isinstance(value, torch.Tensor):
        raise _NotSliceable
    if value.dim() == 1 and value.shape[0] == positions:
        return value[start:stop]
    if value.dim() >= 2 and value.shape[0] == 1 and value.shape[1] == positions:
        return value[:, start:stop]
    raise _NotSliceable


@dataclass
class _Call:
    """One decoder layer's call in a pass: its own forward and the keyword arguments."""

    forward: functools.partial  # the layer's class forward, bound to the layer and kwargs
    positions: int
    chunk: int

    def __post_init__(self) -> None:
        kwargs = self.forward.keywords
        if kwargs.get("attention_mask") is not None or kwargs.get("cache") is not None:
            raise _NotSliceable
        if kwargs.get("past_key_values") is not None or kwargs.get("cu_seq_lens_q") is None:
            raise _NotSliceable
        for name, value in kwargs.items():
            if name in _BY_POSITION or name in _PASSED:
                continue
            if isinstance(value, torch.Tensor) or (
                isinstance(value, tuple) and any(isinstance(v, torch.Tensor) for v in value)
            ):
                raise _NotSliceable  # something along the positions we do not know

    def slices(self) -> list[tuple[int, int]]:
        return [
            (start, min(start + self.chunk, self.positions))
            for start in range(0, self.positions, self.chunk)
        ]

    def run(self, hidden: torch.Tensor, start: int, stop: int):  # type: ignore[no-untyped-def]
        """The layer's forward on positions ``start:stop`` (``hidden``: those positions)."""
        kwargs = dict(self.forward.keywords)
        for name in _BY_POSITION:
            if kwargs.get(name) is not None:
                kwargs[name] = _slice_value(kwargs[name], start, stop, self.positions)
        return self.forward.func(*self.forward.args, hidden, **kwargs)

    def keys(self, hidden: torch.Tensor, start: int, stop: int):  # type: ignore[no-untyped-def]
        """The keys and values of positions ``start:stop``, as the attention receives them."""
        with packing.capture_keys() as captured:
            try:
                self.run(hidden, start, stop)
            except packing.KeysCaptured:
                pass
        if captured.key is None:
            raise _NotSliceable  # the layer never reached an attention that takes them
        return captured.key, captured.value

    def all_keys(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every position's keys and values, (1, kv_heads, T, d) each, without a graph."""
        with torch.no_grad():
            parts = [self.keys(hidden[:, a:b], a, b) for a, b in self.slices()]
        return torch.cat([k for k, _ in parts], dim=2), torch.cat([v for _, v in parts], dim=2)

    def output(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layer's output for every position, a slice at a time, without a graph."""
        with torch.no_grad():
            key, value = self.all_keys(hidden)
            out = torch.empty_like(hidden)
            for a, b in self.slices():
                with packing.slice_queries(key, value, a):
                    part = self.run(hidden[:, a:b], a, b)
                if not isinstance(part, torch.Tensor) or part.shape != (1, b - a, hidden.shape[2]):
                    raise _NotSliceable  # not one tensor of its input's shape
                out[:, a:b] = part
        return out

    def backward(self, hidden: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """The input's gradient, the weights' added into their ``.grad`` (module docstring)."""
        key, value = self.all_keys(hidden)
        key.requires_grad_(True)
        value.requires_grad_(True)
        grad_in = torch.empty_like(hidden)
        with torch.enable_grad():
            for a, b in self.slices():
                part = hidden[:, a:b].detach().requires_grad_(True)
                with packing.slice_queries(key, value, a):
                    out = self.run(part, a, b)
                torch.autograd.backward(out, grad[:, a:b])
                assert part.grad is not None, "a slice's input reaches its output"
                grad_in[:, a:b] = part.grad
                del out, part
            key_grad, value_grad = key.grad, value.grad
            del key, value
            for a, b in self.slices():
                part = hidden[:, a:b].detach().requires_grad_(True)
                k, v = self.keys(part, a, b)
                if key_grad is None or value_grad is None:
                    break  # no query read them (cannot happen: each position reads its own)
                torch.autograd.backward(
                    [k, v], [key_grad[:, :, a:b], value_grad[:, :, a:b]]
                )  # fmt: skip
                if part.grad is not None:
                    grad_in[:, a:b] += part.grad
                del k, v, part
        return grad_in


@dataclass
class _Block:
    """``LAYERS_PER_CHECKPOINT`` consecutive layers whose first input alone is kept."""

    first: torch.Tensor | None  # the first layer's input (detached), until its backward
    calls: list[_Call | None] = field(default_factory=list)  # None once its backward ran
    last: weakref.ref | None = None  # the last layer's output, to check the next's input
    release: Callable[[], object] | None = None  # hands freed memory back (trainer/heap.py)

    def input_of(self, index: int) -> torch.Tensor:
        """The input of the block's ``index``-th layer, the layers before it run again."""
        hidden = self.first
        assert hidden is not None, "a block's first layer runs its backward last"
        for call in self.calls[:index]:
            assert call is not None, "a block's layers run their backward last to first"
            hidden = call.output(hidden)
        return hidden


class _SlicedLayer(torch.autograd.Function):
    """One layer of a block: its output; its backward, the input's gradient (the weights'
    added into their ``.grad`` as it runs)."""

    @staticmethod
    def forward(ctx, hidden, block, index):  # type: ignore[no-untyped-def,override]
        ctx.block, ctx.index = block, index
        if index == 0:
            ctx.save_for_backward(hidden)
        out = block.calls[index].output(hidden.detach())
        if block.release is not None:
            block.release()  # the slices' freed pages, before the next layer's forward
        return out

    @staticmethod
    def backward(ctx, grad):  # type: ignore[no-untyped-def,override]
        # autograd keeps a node until the whole backward pass is done, and frees only its
        # saved tensors as it goes: what ctx holds is let go of here, or every block's first
        # input would stay to the end
        block, index, ctx.block = ctx.block, ctx.index, None
        if index == 0:
            (hidden,) = ctx.saved_tensors
            hidden = hidden.detach()
            block.first = None  # the block's last backward: its later layers' are done
        else:
            hidden = block.input_of(index)
        grad_in = block.calls[index].backward(hidden, grad)
        block.calls[index] = None
        del hidden
        if block.release is not None:
            block.release()  # this layer's freed pages, before the next layer's backward
        return grad_in, None, None


class Slicer:
    """The checkpointing function of a model's decoder layers: a pass of more than ``chunk``
    positions runs sliced (the module docstring), any other as ``checkpoint`` runs it."""

    def __init__(self, chunk: int, plain, release: Callable[[], object] | None = None) -> None:  # type: ignore[no-untyped-def]
        self.chunk = chunk
        self.plain = plain  # the checkpointing function the layers had
        self.release = release  # after each sliced layer's forward and backward (``enable``)
        # the block the last sliced layer joined, while its pass's graph holds it
        self.open: weakref.ref[_Block] | None = None
        self.unsliceable: set[int] = set()  # layers whose calls ran plain: don't try again

    def __call__(self, index: int, forward, *args):  # type: ignore[no-untyped-def]
        hidden = args[0] if len(args) == 1 else None
        if (
            not isinstance(hidden, torch.Tensor)
            or hidden.dim() != 3
            or index in self.unsliceable
            or hidden.shape[1] <= self.chunk
            or hidden.shape[0] != 1
            or not hidden.requires_grad
            or not torch.is_grad_enabled()
        ):
            self.open = None
            return self.plain(forward, *args)
        layer = forward.args[0] if forward.args else None
        if not isinstance(layer, torch.nn.Module) or any(
            type(p) not in (torch.Tensor, torch.nn.Parameter) for p in layer.parameters()
        ):  # sharded (DTensor) weights: their hooks gather and reduce around the layer's own call
            self.unsliceable.add(index)
            return self.plain(forward, *args)
        try:
            call = _Call(forward, hidden.shape[1], self.chunk)
            opened = self.open() if self.open is not None else None
            if (
                opened is not None
                and opened.last is not None
                and opened.last() is hidden
                and len(opened.calls) < LAYERS_PER_CHECKPOINT
            ):  # the layer after a kept input: it joins that block
                block, at = opened, len(opened.calls)
            else:
                block, at = _Block(first=hidden.detach(), release=self.release), 0
            block.calls.append(call)
            out = _SlicedLayer.apply(hidden, block, at)
        except _NotSliceable:
            self.unsliceable.add(index)
            self.open = None
            return self.plain(forward, *args)
        block.last = weakref.ref(out)
        self.open = weakref.ref(block)
        return out


def decoder_layers(model) -> list[torch.nn.Module]:  # type: ignore[no-untyped-def]
    """The layers of ``model`` that transformers checkpoints (``GradientCheckpointingLayer``),
    in order."""
    return [
        module
        for module in model.modules()
        if getattr(module, "gradient_checkpointing", False)
        and callable(getattr(module, "_gradient_checkpointing_func", None))
        and type(module).__name__.endswith("Layer")
    ]


def sliceable(model) -> bool:  # type: ignore[no-untyped-def]
    """Whether ``model``'s layers may run sliced: packed attention on, no dropout, no
    experts (the module docstring)."""
    if not packing.enabled(model):
        return False
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if getattr(config, "attention_dropout", 0.0):
        return False
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return False
        if any(word in type(module).__name__.lower() for word in _EXPERTS):
            return False
    return True


def enable(model, chunk: int, release: Callable[[], object] | None = None) -> int:  # type: ignore[no-untyped-def]
    """Run ``model``'s checkpointed decoder layers sliced in passes of more than ``chunk``
    positions; returns how many layers now may. ``chunk`` 0, a model without checkpointing on
    or not ``sliceable``: nothing changes. Call it after checkpointing is enabled.
    ``release``: called after each sliced layer's forward and backward (``heap.release``: the
    pages the layer freed go back to the system before the next layer allocates in other
    sizes; measured on jemalloc, without it 185 MiB of freed pages were held at the end of an
    8,192-position forward pass)."""
    if chunk <= 0 or not sliceable(model):
        return 0
    layers = decoder_layers(model)
    if not layers:
        return 0
    plain = layers[0]._gradient_checkpointing_func
    if isinstance(plain, functools.partial) and isinstance(plain.func, Slicer):
        plain = plain.func.plain  # enabled before: set up anew over the same checkpointing
    slicer = Slicer(chunk, plain, release)
    for index, layer in enumerate(layers):
        layer._gradient_checkpointing_func = functools.partial(slicer, index)  # type: ignore[assignment]
    return len(layers)
