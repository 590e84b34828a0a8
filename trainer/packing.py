"""Padding-free forward passes: a micro-batch's rows packed into one sequence.

A right-padded (b, T) batch spends the decoder's work on every pad position: with rollouts of
uneven length a third of the positions or more (docs/benchmarks.md). Packed, the real tokens of
all rows run as one (1, N) sequence, N the rows' summed lengths, with each row's positions
counted from 0 (so rotary embeddings see what they saw unpacked) and attention kept inside each
row: the linear layers, which are nearly all of a step's work, see N positions and nothing else.

Attention is the one place rows must not mix. ``PACKED_ATTENTION`` is registered with
transformers' attention interface and set on the model (``enable``): given the rows' boundaries
(``cu_seq_lens_q``, the keyword flash-attention's variable-length path reads, passed down to
every layer by the model's forward), it runs causal scaled-dot-product attention on each row's
slice alone, whatever kernel the device's SDPA picks; no (N, N) mask is ever built (the name
has no mask function registered, so transformers builds none). Given no boundaries (a padded
call on a model set up for packing: transformers passes no mask to an attention without a
mask function) it is causal SDPA over the padded rows, exact for right-padded rows, the
trainer's only kind. Either way the log-probs are exact: each row's tokens meet the same
weights, positions and keys as in their padded row. Attention that is more than that (a soft
cap, a sliding window, gpt-oss's sinks), or a packed forward whose layers did not pass the
boundaries down, is an error, never rows attending to each other.
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass

import torch

PACKED_ATTENTION = "agentarium_packed"
# Set while a packed forward runs (``packed_forward``): attention without the rows' boundaries
# is then an error, not rows silently attending to each other.
_PACKED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("packed", default=False)


@contextlib.contextmanager
def packed_forward():
    """Around a forward pass of packed rows. (A checkpointed layer's recomputation in the
    backward pass gets the boundaries it was first called with.)"""
    token = _PACKED_FORWARD.set(True)
    try:
        yield
    finally:
        _PACKED_FORWARD.reset(token)


def _repeat_kv(states: torch.Tensor, groups: int) -> torch.Tensor:
    """(b, kv_heads, T, d) -> (b, kv_heads * groups, T, d): grouped-query keys and values."""
    if groups == 1:
        return states
    b, heads, t, d = states.shape
    return states[:, :, None].expand(b, heads, groups, t, d).reshape(b, heads * groups, t, d)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,  # (1, heads, N, d)
    key: torch.Tensor,  # (1, kv_heads, N, d)
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each packed row (``cu_seq_lens_q``), or over a padded batch."""
    groups = getattr(module, "num_key_value_groups", 1)
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    other = [k for k in ("softcap", "sliding_window", "s_aux") if kwargs.get(k) is not None]
    if other:  # supported() keeps such models padded; one that got here anyway must not mix
        raise NotImplementedError(
            f"packed rows: this model's attention has {', '.join(other)}, which packed "
            "attention does not apply: train it with --no-pack-rows"
        )
    dropout = dropout if module.training else 0.0
    sdpa = torch.nn.functional.scaled_dot_product_attention
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is None and _PACKED_FORWARD.get():
        raise RuntimeError(  # the rows would attend to each other: never silently
            "packed rows: the model's layers did not pass the rows' boundaries "
            "(cu_seq_lens_q) to its attention: train it with --no-pack-rows"
        )
    if bounds is not None:
        # the edges on the host (no device sync per layer), as the packed forward passes them
        edges = kwargs.get("packed_row_edges") or bounds.tolist()
        parts = [
            sdpa(
                query[:, :, start:stop],
                key[:, :, start:stop],
                value[:, :, start:stop],
                dropout_p=dropout,
                is_causal=True,
                scale=scaling,
            )
            for start, stop in zip(edges[:-1], edges[1:], strict=False)
            if stop > start
        ]
        out = torch.cat(parts, dim=2) if parts else torch.zeros_like(query)
    elif attention_mask is None:
        out = sdpa(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling)
    else:
        t = query.shape[2]
        keep = attention_mask.to(torch.bool)
        if keep.dim() == 2:  # (b, T) padding mask: causal and padding, (b, 1, T, T)
            causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
            keep = causal[None, None] & keep[:, None, None, :]
        out = sdpa(query, key, value, attn_mask=keep, dropout_p=dropout, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``PACKED_ATTENTION`` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def plain_causal(config) -> bool:
    """Whether a transformers config's attention is plain causal attention: every layer full
    attention (``layer_types``, where the config has them; else no sliding window), no soft
    cap. Qwen2's configs carry a ``sliding_window`` with ``use_sliding_window`` false: their
    ``layer_types`` say full attention."""
    config = getattr(config, "text_config", None) or config
    if getattr(config, "attn_logit_softcapping", None):
        return False
    kinds = getattr(config, "layer_types", None)
    if kinds:
        return all(kind == "full_attention" for kind in kinds)
    return not any(getattr(config, name, None) for name in ("sliding_window", "use_sliding_window"))


def supported(model) -> bool:
    """Whether ``model`` can take packed rows: a transformers model whose attention goes
    through the attention interface (``set_attn_implementation``) and is plain causal
    attention (no sliding window, no soft cap: those models run padded)."""
    config = getattr(model, "config", None)
    if config is None or not plain_causal(config):
        return False
    return callable(getattr(model, "set_attn_implementation", None))


def model_dir_supported(model_dir) -> bool:
    """``supported`` read from a model directory's config alone (no weights loaded), so the
    driver of sharded ranks counts passes as the ranks will run them."""
    from transformers import AutoConfig

    return plain_causal(AutoConfig.from_pretrained(str(model_dir)))


def enable(model) -> None:
    """Set ``model`` (a transformers model, unwrapped) to attend through ``PACKED_ATTENTION``."""
    register()
    model.set_attn_implementation(PACKED_ATTENTION)


def enabled(model) -> bool:
    config = getattr(model, "config", None)
    return getattr(config, "_attn_implementation", None) == PACKED_ATTENTION


@dataclass(frozen=True)
class Packed:
    """A padded micro-batch's real tokens as one sequence, and how to find them again."""

    input_ids: torch.Tensor  # (1, N) long
    position_ids: torch.Tensor  # (1, N) long, from 0 in each row
    bounds: torch.Tensor  # (rows + 1,) int32: row i is [bounds[i], bounds[i + 1])
    lengths: list[int]

    @property
    def tokens(self) -> int:
        return int(self.bounds[-1])

    def forward_kwargs(self) -> dict:
        """What the model's forward takes to run the rows packed."""
        longest = max(self.lengths, default=0)
        edges = [0]
        for n in self.lengths:
            edges.append(edges[-1] + n)
        return {
            "packed_row_edges": edges,
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.bounds,
            "cu_seq_lens_k": self.bounds,
            "max_length_q": longest,
            "max_length_k": longest,
        }

    def flat_index(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The packed positions of padded positions (rows[i], cols[i]) (real tokens only)."""
        return self.bounds[:-1].to(rows.device, torch.long)[rows] + cols

    def unpack(self, flat: torch.Tensor, width: int) -> torch.Tensor:
        """(1, N, ...) -> (rows, width, ...), zeros past each row's end (differentiable)."""
        rows = len(self.lengths)
        out = flat.new_zeros((rows, width, *flat.shape[2:]))
        row_of = torch.repeat_interleave(
            torch.arange(rows, device=flat.device),
            torch.tensor(self.lengths, device=flat.device),
        )
        col_of = (
            torch.arange(self.tokens, device=flat.device)
            - self.bounds[:-1].to(flat.device, torch.long)[row_of]
        )
        return out.index_put((row_of, col_of), flat[0])


def pack(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """The rows of a right-padded (b, T) batch, packed (rows keep their order)."""
    lengths = [int(n) for n in attention_mask.sum(-1).tolist()]
    real = attention_mask.to(torch.bool)
    if not all(bool(real[i, :n].all()) for i, n in enumerate(lengths)):
        raise ValueError("packing needs right-padded rows (real tokens first, then padding)")
    device = input_ids.device
    bounds = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=device)
    bounds[1:] = torch.tensor(lengths, device=device).cumsum(0)
    positions = torch.cat(
        [torch.arange(n, device=device) for n in lengths]
        or [torch.zeros(0, dtype=torch.long, device=device)]
    )
    return Packed(
        input_ids=input_ids[real][None],
        position_ids=positions[None],
        bounds=bounds,
        lengths=lengths,
    )
