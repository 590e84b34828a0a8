"""A batch's KV cache, left-padded so that sequences of different lengths share one tensor.

Row i of every layer's keys/values holds sequence i's cached tokens right-aligned; `mask`
marks which columns are real (a row that reused a cached prefix may have padding between its
prefix and the rest of its prompt). Rows leave (`select`) and join (`concat`) between decode steps,
which is all continuous batching needs from the cache. transformers only sees a cache built on
these tensors for the length of one forward pass: a prefill's `DynamicCache`, or a decode step's
layers (`model.in_place_layer`) writing into the room `make_room` keeps after them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# Columns a decode step's buffers grow by at a time (``make_room``): a copy of the cache every
# ROOM steps instead of two a step (transformers' DynamicCache rebuilds and concatenates).
ROOM = 64


@dataclass
class PaddedKV:
    keys: list[torch.Tensor]  # per layer (B, H_kv, L, D)
    values: list[torch.Tensor]  # per layer (B, H_kv, L, D)
    mask: torch.Tensor  # (B, L) int64, 1 = real token
    # per layer (B, H_kv, L + room, D): keys/values are views of their first L columns, so a
    # decode step writes its column in place (make_room); None until a decode step needs it,
    # and every new PaddedKV (select, concat, left_pad) starts without
    buffers: tuple[list[torch.Tensor], list[torch.Tensor]] | None = field(default=None, repr=False)

    @property
    def batch(self) -> int:
        return int(self.mask.shape[0])

    @property
    def length(self) -> int:
        return int(self.mask.shape[1])

    def select(self, rows: list[int]) -> PaddedKV:
        """Keep `rows` (in that order), dropping the left columns that became all padding."""
        index = torch.tensor(rows, dtype=torch.long)
        mask = self.mask.index_select(0, index)
        lead = int((mask.sum(0) == 0).long().cumprod(0).sum())
        return PaddedKV(
            keys=[k.index_select(0, index)[:, :, lead:] for k in self.keys],
            values=[v.index_select(0, index)[:, :, lead:] for v in self.values],
            mask=mask[:, lead:],
        )

    def row(self, i: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Row i's real tokens' keys and values per layer, (H_kv, n, D), as copies."""
        columns = self.mask[i].nonzero().squeeze(1)
        keys = [k[i].index_select(1, columns) for k in self.keys]
        return keys, [v[i].index_select(1, columns) for v in self.values]

    def make_room(self, columns: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Buffers per layer whose first L columns are the keys and values (which become views
        of them) with at least ``columns`` free after them, for a decode step to write into
        (``model.in_place_layer``). Grown ``ROOM`` columns at a time: one copy of the cache then."""
        width = self.keys[0].shape[2]
        if self.buffers is not None and self.buffers[0][0].shape[2] - width >= columns:
            return self.buffers
        grown: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        for source, target in ((self.keys, grown[0]), (self.values, grown[1])):
            for tensor in source:
                b, h, _, d = tensor.shape
                buffer = tensor.new_zeros((b, h, width + max(columns, ROOM), d))
                buffer[:, :, :width] = tensor
                target.append(buffer)
        self.buffers = grown
        self.keys = [buffer[:, :, :width] for buffer in grown[0]]
        self.values = [buffer[:, :, :width] for buffer in grown[1]]
        return grown

    def append_column(self) -> None:
        """Account for one new real token per row (the decode step wrote its K/V)."""
        ones = torch.ones((self.batch, 1), dtype=self.mask.dtype)
        self.mask = torch.cat([self.mask, ones], dim=1)

    @staticmethod
    def concat(a: PaddedKV, b: PaddedKV) -> PaddedKV:
        """Stack two batches' rows, left-padding the shorter one."""
        length = max(a.length, b.length)
        a, b = a.left_pad(length), b.left_pad(length)
        return PaddedKV(
            keys=[torch.cat([x, y]) for x, y in zip(a.keys, b.keys, strict=True)],
            values=[torch.cat([x, y]) for x, y in zip(a.values, b.values, strict=True)],
            mask=torch.cat([a.mask, b.mask]),
        )

    def left_pad(self, length: int) -> PaddedKV:
        pad = length - self.length
        if pad <= 0:
            return self
        return PaddedKV(
            keys=[_left_pad(k, pad) for k in self.keys],
            values=[_left_pad(v, pad) for v in self.values],
            mask=torch.cat([torch.zeros((self.batch, pad), dtype=self.mask.dtype), self.mask], 1),
        )

    def zero_padding(self) -> None:
        """Zero K/V in padding columns: attention weighs them by exactly 0, but 0 * NaN is NaN,
        and a padding query attends to nothing, which can leave NaN there. In place: the
        tensors are a prefill's own, and a copy of every layer would double its peak memory."""
        keep = self.mask[:, None, :, None].to(self.keys[0].dtype)  # (B, 1, L, 1)
        for tensor in (*self.keys, *self.values):
            tensor.nan_to_num_().mul_(keep)


def _left_pad(x: torch.Tensor, pad: int) -> torch.Tensor:
    b, h, _, d = x.shape
    return torch.cat([x.new_zeros((b, h, pad, d)), x], dim=2)
