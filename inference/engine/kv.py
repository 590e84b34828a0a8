"""A batch's KV cache, left-padded so that sequences of different lengths share one tensor.

Row i of every layer's keys/values holds sequence i's cached tokens right-aligned; `mask`
marks which columns are real (a row that reused a cached prefix may have padding between its
prefix and the rest of its prompt). Rows leave (`select`) and join (`concat`) between decode steps,
which is all continuous batching needs from the cache. transformers only sees a cache built on
these tensors for the length of one forward pass: a prefill's `DynamicCache`, or a decode step's
layers (`model.in_place_layer`) writing into the room `make_room` keeps after them.

Once a decode step has needed room, the keys and values are views of per-layer buffers with
spare rows, spare columns on the left and room on the right, and rows leave and join inside
them: a leaving row's slot is filled by a row from the end, a joining row is written into the
spare rows, and only the moved or joined rows are copied. Rebuilding the whole cache at every
leave and join (and copying it again into room at the next step) was 40 % of the calculator
recipe's engine time (py-spy, 2026-12-07).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Columns a decode step's buffers grow by at a time (``make_room``): a copy of the cache every
# ROOM steps instead of two a step (transformers' DynamicCache rebuilds and concatenates).
ROOM = 64
# Spare rows a rebuilt buffer keeps for rows that join later: at least this many, or a quarter
# of the rows it holds (a burst of joiners, a GRPO group, needs no rebuild of its own).
SPARE_ROWS = 8
# A buffer whose rows are four times more than those left in it is given back: the cache is
# copied into tensors of its own size (one long row must not hold a full batch's memory).
SHRINK_BELOW = 4

Buffers = tuple[list[torch.Tensor], list[torch.Tensor]]  # per layer: keys', values'


@dataclass
class PaddedKV:
    keys: list[torch.Tensor]  # per layer (B, H_kv, L, D)
    values: list[torch.Tensor]  # per layer (B, H_kv, L, D)
    mask: torch.Tensor  # (B, L) int64, 1 = real token
    # per layer (R, H_kv, C, D), R >= B rows and C >= start + L + the room kept after: keys
    # and values are views of rows [:B], columns [start:start + L], so a decode step writes its
    # column in place (make_room) and rows leave and join in place (select, concat); None
    # until a decode step needs room (a prefill's tensors are its own)
    buffers: Buffers | None = field(default=None, repr=False)
    start: int = field(default=0, repr=False)

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    @torch.inference_mode()  # the tensors are inference tensors: updated in place in that mode
    def select(self, rows: list[int]) -> PaddedKV:
        """Keep `rows` (in that order), dropping the left columns that became all padding.

        Inside buffers, row j takes row ``rows[j]`` in place, copying only the rows that move
        (``fill_order`` moves as few as rows leave); the result shares the buffers."""
        index = torch.tensor(rows, dtype=torch.long)
        mask = self.mask.index_select(0, index)
        lead = int((mask.sum(0) == 0).long().cumprod(0).sum())
        if self.buffers is None or len(rows) * SHRINK_BELOW < self.buffers[0][0].shape[0]:
            return PaddedKV(
                keys=[k.index_select(0, index)[:, :, lead:] for k in self.keys],
                values=[v.index_select(0, index)[:, :, lead:] for v in self.values],
                mask=mask[:, lead:],
            )
        moved = [(j, r) for j, r in enumerate(rows) if j != r]
        begin, end = self.start, self.start + self.length
        if moved:
            targets = torch.tensor([j for j, _ in moved], dtype=torch.long)
            sources = torch.tensor([r for _, r in moved], dtype=torch.long)
            for buffer in (*self.buffers[0], *self.buffers[1]):
                # the sources are gathered into a new tensor first: any order is safe
                buffer[targets, :, begin:end] = buffer[sources, :, begin:end]
        return _within(self.buffers, len(rows), begin + lead, mask[:, lead:])

    def row(self, i: int) -> Buffers:
        """Row i's real tokens' keys and values per layer, (H_kv, n, D), as copies."""
        columns = self.mask[i].nonzero().squeeze(1)
        keys = [k[i].index_select(1, columns) for k in self.keys]
        return keys, [v[i].index_select(1, columns) for v in self.values]

    @torch.inference_mode()
    def make_room(self, columns: int) -> Buffers:
        """Views per layer whose first L columns are the keys and values, with at least
        ``columns`` free after them, for a decode step to write into (``model.in_place_layer``).
        Buffers grow ``ROOM`` columns at a time: one copy of the cache then."""
        width = self.length
        if self.buffers is None or self.buffers[0][0].shape[2] - self.start - width < columns:
            rows = self.batch + spare_rows(self.batch)
            self._rebuild(rows=rows, left=ROOM, right=max(columns, ROOM))
        assert self.buffers is not None
        return _views(self.buffers, self.batch, self.start, None)

    def _rebuild(self, *, rows: int, left: int, right: int) -> None:
        """New buffers holding this cache with ``rows`` rows in all, ``left`` columns before it
        and ``right`` after; keys and values become views of them."""
        width = self.length
        grown: Buffers = ([], [])
        for source, target in ((self.keys, grown[0]), (self.values, grown[1])):
            for tensor in source:
                b, h, _, d = tensor.shape
                buffer = tensor.new_zeros((rows, h, left + width + right, d))
                buffer[:b, :, left : left + width] = tensor
                target.append(buffer)
        self.buffers, self.start = grown, left
        self.keys, self.values = _views(grown, self.batch, left, left + width)

    def append_column(self) -> None:
        """Account for one new real token per row (the decode step wrote its K/V)."""
        ones = torch.ones((self.batch, 1), dtype=self.mask.dtype)
        self.mask = torch.cat([self.mask, ones], dim=1)

    @staticmethod
    @torch.inference_mode()
    def concat(a: PaddedKV, b: PaddedKV) -> PaddedKV:
        """Stack two batches' rows, left-padding the shorter one. Into ``a``'s buffers when they
        have the rows and the columns (the result shares them: ``a`` is not to be used after),
        else into new buffers with spare rows and columns on both sides."""
        length = max(a.length, b.length)
        rows = a.batch + b.batch
        mask = torch.cat([a.left_pad_mask(length), b.left_pad_mask(length)])
        wider = length - a.length  # columns a's rows take on the left, as padding
        if a.buffers is None or a.buffers[0][0].shape[0] < rows or a.start < wider:
            a._rebuild(rows=rows + spare_rows(rows), left=wider + ROOM, right=ROOM)
        assert a.buffers is not None
        end = a.start + a.length
        begin = end - length
        for buffers, joining in ((a.buffers[0], b.keys), (a.buffers[1], b.values)):
            for buffer, tensor in zip(buffers, joining, strict=True):
                if begin < a.start:  # columns a had dropped, now padding of its rows
                    buffer[: a.batch, :, begin : a.start] = 0
                buffer[a.batch : rows, :, begin : end - b.length] = 0
                buffer[a.batch : rows, :, end - b.length : end] = tensor
        return _within(a.buffers, rows, begin, mask)

    def left_pad_mask(self, length: int) -> torch.Tensor:
        pad = length - self.length
        if pad <= 0:
            return self.mask
        return torch.cat([torch.zeros((self.batch, pad), dtype=self.mask.dtype), self.mask], 1)

    def zero_padding(self) -> None:
        """Zero K/V in padding columns: attention weighs them by exactly 0, but 0 * NaN is NaN,
        and a padding query attends to nothing, which can leave NaN there. In place: the
        tensors are a prefill's own, and a copy of every layer would double its peak memory."""
        keep = self.mask[:, None, :, None].to(self.keys[0].dtype)  # (B, 1, L, 1)
        for tensor in (*self.keys, *self.values):
            tensor.nan_to_num_().mul_(keep)


def _views(buffers: Buffers, rows: int, start: int, end: int | None) -> Buffers:
    """Rows ``[:rows]`` and columns ``[start:end]`` of each layer's buffers, as views."""
    return (
        [b[:rows, :, start:end] for b in buffers[0]],
        [b[:rows, :, start:end] for b in buffers[1]],
    )


def _within(buffers: Buffers, rows: int, start: int, mask: torch.Tensor) -> PaddedKV:
    """A cache of ``rows`` rows whose keys and values are the buffers' columns from ``start``,
    as many as ``mask`` has."""
    keys, values = _views(buffers, rows, start, start + int(mask.shape[1]))
    return PaddedKV(keys=keys, values=values, mask=mask, buffers=buffers, start=start)


def spare_rows(rows: int) -> int:
    return max(SPARE_ROWS, rows // 4)


def fill_order(keep: list[int], rows: int) -> list[int]:
    """The order ``select`` takes for the ascending rows ``keep`` of ``rows``: each kept row
    stays where it is, and the slots of the rows that left are filled by the kept rows past
    the new end, so as few rows move as left."""
    n = len(keep)
    kept = set(keep)
    movers = iter(r for r in keep if r >= n)
    return [j if j in kept else next(movers) for j in range(n)]
