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
from dataclasses import dataclass, field

import torch

PACKED_ATTENTION = "agentarium_packed"
# scaled_dot_product_attention's enable_gqa (torch 2.5 and later)
_SDPA_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)
# Set while a packed forward runs (``packed_forward``): attention without the rows' boundaries
# is then an error, not rows silently attending to each other.
_PACKED_FORWARD: contextvars.ContextVar[bool] = contextvars.ContextVar("packed", default=False)


class KeysCaptured(Exception):
    """Raised by the attention under ``capture_keys``, once it has the keys and values: the
    rest of the layer need not run."""


@dataclass
class _Captured:
    key: torch.Tensor | None = None
    value: torch.Tensor | None = None


@dataclass(frozen=True)
class _Queries:
    key: torch.Tensor  # (1, kv_heads, N, d): every position's keys of the pass
    value: torch.Tensor
    start: int  # the packed position of the first query


# Set by trainer/sliced_layers.py around a layer's forward on a slice of a pass's positions:
# the attention hands over its keys and values (``_Captured``), or reads the whole pass's
# (``_Queries``) for the slice's queries.
_SLICE: contextvars.ContextVar[_Captured | _Queries | None] = contextvars.ContextVar(
    "slice", default=None
)


@contextlib.contextmanager
def capture_keys():
    """Around a layer's forward: its attention records the keys and values it is given in the
    object yielded and raises ``KeysCaptured``."""
    captured = _Captured()
    token = _SLICE.set(captured)
    try:
        yield captured
    finally:
        _SLICE.reset(token)


@contextlib.contextmanager
def slice_queries(key: torch.Tensor, value: torch.Tensor, start: int):
    """Around a layer's forward on positions ``start:`` of a packed pass: its attention reads
    ``key`` and ``value`` (every position's) instead of the slice's own."""
    token = _SLICE.set(_Queries(key, value, start))
    try:
        yield
    finally:
        _SLICE.reset(token)


def _lower_right(queries: int, keys: int, device) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """(queries, keys) causal mask of the last ``queries`` positions of ``keys``."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


def _sliced_attention(
    query: torch.Tensor, sliced: _Queries, edges: list[int], prefixes, scaling, gqa: dict
) -> torch.Tensor:
    """Causal attention of the queries at packed positions ``sliced.start:`` within their
    rows, over the whole pass's keys: what the whole pass's attention gives those positions."""
    first, last = sliced.start, sliced.start + query.shape[2]
    key, value, parts = sliced.key, sliced.value, []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for (start, stop), (at, shared) in zip(
        zip(edges[:-1], edges[1:], strict=True), prefixes, strict=True
    ):
        a, b = max(start, first), min(stop, last)
        if b <= a:
            continue
        q = query[:, :, a - first : b - first]
        keys, values = key[:, :, start:b], value[:, :, start:b]
        if shared:
            seen = slice(at, at + shared)
            keys = torch.cat([key[:, :, seen], keys], dim=2)
            values = torch.cat([value[:, :, seen], values], dim=2)
        if a == start and not shared:  # from the row's first position: plain causal
            parts.append(sdpa(q, keys, values, is_causal=True, scale=scaling, **gqa))
            continue
        keep = _lower_right(b - a, keys.shape[2], query.device)
        parts.append(sdpa(q, keys, values, attn_mask=keep, scale=scaling, **gqa))
    return torch.cat(parts, dim=2)


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
    # grouped-query keys and values as they are where SDPA takes them so (torch 2.5+: no
    # (heads, N, d) copies, kept for the backward pass: 38 MB a layer at 8,192 positions for
    # SmolLM2), else repeated for each head
    gqa: dict = {"enable_gqa": True} if groups > 1 and _SDPA_GQA else {}
    sliced = _SLICE.get()
    if isinstance(sliced, _Captured):
        sliced.key, sliced.value = key, value
        raise KeysCaptured
    if not gqa:
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
    if sliced is not None:
        if bounds is None or dropout:
            raise RuntimeError("a sliced layer's attention needs the rows' boundaries, no dropout")
        edges = kwargs.get("packed_row_edges") or bounds.tolist()
        prefixes = kwargs.get("packed_prefixes") or [(0, 0)] * (len(edges) - 1)
        if not gqa:
            sliced = _Queries(
                _repeat_kv(sliced.key, groups), _repeat_kv(sliced.value, groups), sliced.start
            )
        out = _sliced_attention(query, sliced, edges, prefixes, scaling, gqa)
        return out.transpose(1, 2).contiguous(), None
    if bounds is None and _PACKED_FORWARD.get():
        raise RuntimeError(  # the rows would attend to each other: never silently
            "packed rows: the model's layers did not pass the rows' boundaries "
            "(cu_seq_lens_q) to its attention: train it with --no-pack-rows"
        )
    if bounds is not None:
        # the edges on the host (no device sync per layer), as the packed forward passes them
        edges = kwargs.get("packed_row_edges") or bounds.tolist()
        # with shared prefixes, each segment's (prefix start, prefix length): 0 for a prefix or
        # a row on its own, causal within itself
        prefixes = kwargs.get("packed_prefixes") or [(0, 0)] * (len(edges) - 1)
        parts = []
        for (start, stop), (at, shared) in zip(
            zip(edges[:-1], edges[1:], strict=True), prefixes, strict=True
        ):
            if stop <= start:
                continue
            own = slice(start, stop)
            if not shared:
                parts.append(
                    sdpa(query[:, :, own], key[:, :, own], value[:, :, own],
                         dropout_p=dropout, is_causal=True, scale=scaling, **gqa)
                )  # fmt: skip
                continue
            # a row after its shared prefix: every prefix key, then causal over its own tokens
            n, seen = stop - start, slice(at, at + shared)
            keep = torch.ones(n, shared + n, dtype=torch.bool, device=query.device)
            keep[:, shared:] = torch.ones(n, n, dtype=torch.bool, device=query.device).tril()
            keys = torch.cat([key[:, :, seen], key[:, :, own]], dim=2)
            values = torch.cat([value[:, :, seen], value[:, :, own]], dim=2)
            parts.append(
                sdpa(query[:, :, own], keys, values, attn_mask=keep, dropout_p=dropout,
                     scale=scaling, **gqa)
            )  # fmt: skip
        out = torch.cat(parts, dim=2) if parts else torch.zeros_like(query)
    elif attention_mask is None:
        out = sdpa(query, key, value, dropout_p=dropout, is_causal=True, scale=scaling, **gqa)
    else:
        t = query.shape[2]
        keep = attention_mask.to(torch.bool)
        if keep.dim() == 2:  # (b, T) padding mask: causal and padding, (b, 1, T, T)
            causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
            keep = causal[None, None] & keep[:, None, None, :]
        out = sdpa(query, key, value, attn_mask=keep, dropout_p=dropout, scale=scaling, **gqa)
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


# A common prefix shorter than this is packed with each row as before: it would save little
# and take the rows after it off the plain causal kernel.
MIN_SHARED_PREFIX = 16


def _common(a: torch.Tensor, b: torch.Tensor, limit: int) -> int:
    """How many of their first ``limit`` tokens the 1-D ``a`` and ``b`` share."""
    differs = (a[:limit] != b[:limit]).nonzero()
    return int(differs[0, 0]) if len(differs) else limit


class PrefixRuns:
    """Consecutive rows grouped into runs that begin with the same tokens, fed one row at a
    time (greedy, so a pass's runs are the same whether its rows come one by one, as a token
    budget adds them, or all at once). A row joins the run before it when they share at least
    ``MIN_SHARED_PREFIX`` tokens and the run then saves no fewer tokens than without it: a
    group's rows sharing their prompt form a run, the next group (another prompt) starts its
    own, and groups sharing few-shot examples before their questions share those."""

    def __init__(self) -> None:
        self.runs: list[list[int]] = []  # [first row, rows, shared tokens]
        self._first: torch.Tensor | None = None  # the last run's first row's tokens
        self._rows = 0

    def add(self, ids: torch.Tensor, length: int) -> None:
        """The next row: its tokens (1-D, ``length`` real ones first)."""
        row, self._rows = self._rows, self._rows + 1
        if self.runs and self._first is not None:
            first, count, shared = self.runs[-1]
            limit = min(shared if count > 1 else int(self._first.shape[0]), length)
            common = _common(self._first, ids, limit)
            if common >= MIN_SHARED_PREFIX and count * common >= (count - 1) * shared:
                self.runs[-1] = [first, count + 1, common]
                return
        self.runs.append([row, 1, 0])
        self._first = ids[:length]

    def copy(self) -> PrefixRuns:
        """The runs so far, to add to without changing these (the tokens are not copied)."""
        other = PrefixRuns()
        other.runs = [list(run) for run in self.runs]
        other._first, other._rows = self._first, self._rows
        return other

    @property
    def saved(self) -> int:
        """Tokens the runs save: each run's prefix runs once instead of once a row."""
        return sum((count - 1) * shared for _, count, shared in self.runs if count > 1)


@dataclass(frozen=True)
class Packed:
    """A padded micro-batch's real tokens as one sequence, and how to find them again.

    With shared prefixes (``prefix_of`` > 0 somewhere: ``PrefixRuns``), the tokens a run of
    rows all begin with are packed once, as a segment before the run's rows, and each of those
    rows' segments holds the rest of the row, at positions from the prefix's length; its
    attention reads its prefix's keys, then its own causally. A GRPO group's rows share their
    whole prompt, and few-shot prompts share their examples across groups: that work is then
    done once a pass instead of once a row. The results are the unshared pass's: every row's
    token meets the same weights, positions and keys, and the gradient reaching a prefix is
    the sum over the rows that read it.
    """

    input_ids: torch.Tensor  # (1, N) long
    position_ids: torch.Tensor  # (1, N) long, from 0 in each row (from its prefix's length)
    bounds: torch.Tensor  # (segments + 1,) int32: the segments, prefixes and rows, in order
    lengths: list[int]  # each row's whole length, its prefix included
    prefix_of: list[int] = field(default_factory=list)  # each row's shared tokens (0: none)
    prefix_at: list[int] = field(default_factory=list)  # where each row's prefix starts
    own_at: list[int] = field(default_factory=list)  # where each row's own segment starts
    segment_prefix: list[tuple[int, int]] = field(default_factory=list)  # per segment

    @property
    def tokens(self) -> int:
        return int(self.bounds[-1])

    @property
    def shared(self) -> bool:
        return any(self.prefix_of)

    def forward_kwargs(self) -> dict:
        """What the model's forward takes to run the rows packed."""
        longest = max(self.lengths, default=0)
        return {
            "packed_row_edges": [int(e) for e in self.bounds.tolist()],
            "packed_prefixes": self.segment_prefix if self.shared else None,
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "cu_seq_lens_q": self.bounds,
            "cu_seq_lens_k": self.bounds,
            "max_length_q": longest,
            "max_length_k": longest,
        }

    def flat_index(self, rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
        """The packed positions of padded positions (rows[i], cols[i]) (real tokens only); a
        position inside a row's shared prefix is the prefix's, whichever row of it asks."""
        device = rows.device
        own = torch.tensor(self.own_at, device=device, dtype=torch.long)[rows]
        if not self.shared:
            return own + cols
        shared = torch.tensor(self.prefix_of, device=device, dtype=torch.long)[rows]
        at = torch.tensor(self.prefix_at, device=device, dtype=torch.long)[rows]
        return torch.where(cols < shared, at + cols, own + cols - shared)

    def unpack(self, flat: torch.Tensor, width: int) -> torch.Tensor:
        """(1, N, ...) -> (rows, width, ...), zeros past each row's end (differentiable)."""
        rows = len(self.lengths)
        out = flat.new_zeros((rows, width, *flat.shape[2:]))
        row_of = torch.repeat_interleave(
            torch.arange(rows, device=flat.device),
            torch.tensor(self.lengths, device=flat.device),
        )
        col_of = torch.cat(
            [torch.arange(n, device=flat.device) for n in self.lengths]
            or [torch.zeros(0, dtype=torch.long, device=flat.device)]
        )
        return out.index_put((row_of, col_of), flat[0][self.flat_index(row_of, col_of)])


def pack(
    input_ids: torch.Tensor, attention_mask: torch.Tensor, *, share_prefix: bool = False
) -> Packed:
    """The rows of a right-padded (b, T) batch, packed (rows keep their order); with
    ``share_prefix``, the tokens each run of rows begins with packed once (``PrefixRuns``)."""
    lengths = [int(n) for n in attention_mask.sum(-1).tolist()]
    real = attention_mask.to(torch.bool)
    if not all(bool(real[i, :n].all()) for i, n in enumerate(lengths)):
        raise ValueError("packing needs right-padded rows (real tokens first, then padding)")
    device = input_ids.device
    runs = PrefixRuns()
    if share_prefix:
        for i, n in enumerate(lengths):
            runs.add(input_ids[i], n)
    else:
        runs.runs = [[i, 1, 0] for i in range(len(lengths))]
    pieces, positions, sizes = [], [], []
    prefix_of, prefix_at, own_at, segment_prefix = [], [], [], []
    at = 0
    for first, count, shared in runs.runs:
        shared = shared if count > 1 else 0
        start = at
        if shared:
            pieces.append(input_ids[first, :shared])
            positions.append(torch.arange(shared, device=device))
            sizes.append(shared)
            segment_prefix.append((start, 0))  # a prefix: causal on its own
            at += shared
        for row in range(first, first + count):
            n = lengths[row]
            pieces.append(input_ids[row, shared:n])
            positions.append(torch.arange(shared, n, device=device))
            sizes.append(n - shared)
            segment_prefix.append((start, shared))
            prefix_of.append(shared)
            prefix_at.append(start)
            own_at.append(at)
            at += n - shared
    bounds = torch.zeros(len(sizes) + 1, dtype=torch.int32, device=device)
    bounds[1:] = torch.tensor(sizes, device=device, dtype=torch.long).cumsum(0)
    empty = torch.zeros(0, dtype=torch.long, device=device)
    return Packed(
        input_ids=torch.cat(pieces or [empty])[None],
        position_ids=torch.cat(positions or [empty])[None],
        bounds=bounds,
        lengths=lengths,
        prefix_of=prefix_of,
        prefix_at=prefix_at,
        own_at=own_at,
        segment_prefix=segment_prefix,
    )
