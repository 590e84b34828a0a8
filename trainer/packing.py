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
call on a model set up for packing) it is SDPA with the causal and padding mask, as before.
Either way the log-probs are exact: each row's tokens meet the same weights, positions and
keys as in their padded row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

PACKED_ATTENTION = "agentarium_packed"


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
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise NotImplementedError(  # supported() keeps such models padded
            "packed rows: this model's attention has a soft cap or a sliding window"
        )
    dropout = dropout if module.training else 0.0
    sdpa = torch.nn.functional.scaled_dot_product_attention
    bounds = kwargs.get("cu_seq_lens_q")
    if bounds is not None:
        edges = bounds.tolist()
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
        out = torch.cat(parts, dim=2)
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


# config attributes whose attention is more than causal SDPA within a row
_OTHER_ATTENTION = ("sliding_window", "attn_logit_softcapping", "use_sliding_window")


def supported(model) -> bool:
    """Whether ``model`` can take packed rows: a transformers model whose attention goes
    through the attention interface (``set_attn_implementation``) and is plain causal
    attention (no sliding window, no soft cap: those models run padded)."""
    config = getattr(model, "config", None)
    if config is None or any(getattr(config, name, None) for name in _OTHER_ATTENTION):
        return False
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return False
    return callable(getattr(model, "set_attn_implementation", None))


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
        return {
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
