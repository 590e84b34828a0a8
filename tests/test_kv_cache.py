"""The local engine's batch KV cache (inference/engine/kv.py) under continuous batching: rows
join, leave and grow by a column a step, and every row still reads exactly its own tokens'
keys and values, in order, with zeros in its padding, while rows leave and join inside the
buffers without rebuilding them."""

from __future__ import annotations

import random

import torch

from agentarium.inference.engine.kv import ROOM, PaddedKV, fill_order

LAYERS, HEADS, DIM = 2, 3, 4


def prefill(lengths: list[int], tokens: list[list[torch.Tensor]]) -> PaddedKV:
    """What a prefill hands over: rows right-aligned, zeros in the padding, and each row's
    tokens (one (LAYERS, 2, HEADS, DIM) tensor a token) appended to ``tokens``."""
    width = max(lengths)
    keys = [torch.zeros(len(lengths), HEADS, width, DIM) for _ in range(LAYERS)]
    values = [torch.zeros(len(lengths), HEADS, width, DIM) for _ in range(LAYERS)]
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    for row, n in enumerate(lengths):
        own = [torch.randn(LAYERS, 2, HEADS, DIM) for _ in range(n)]
        for col, token in enumerate(own, start=width - n):
            for layer in range(LAYERS):
                keys[layer][row, :, col] = token[layer, 0]
                values[layer][row, :, col] = token[layer, 1]
        mask[row, width - n :] = 1
        tokens.append(own)
    with torch.inference_mode():  # as the engine's forward passes make them
        return PaddedKV(
            keys=[k.clone() for k in keys], values=[v.clone() for v in values], mask=mask
        )


def decode(kv: PaddedKV, tokens: list[list[torch.Tensor]]) -> None:
    """A decode step as model.decode runs it: a new column written into the room."""
    keys, values = kv.make_room(1)
    width = kv.length
    kv.append_column()
    with torch.inference_mode():
        for row, own in enumerate(tokens):
            token = torch.randn(LAYERS, 2, HEADS, DIM)
            own.append(token)
            for layer in range(LAYERS):
                keys[layer][row, :, width] = token[layer, 0]
                values[layer][row, :, width] = token[layer, 1]
    kv.keys = [k[:, :, : width + 1] for k in keys]
    kv.values = [v[:, :, : width + 1] for v in values]


def check(kv: PaddedKV, tokens: list[list[torch.Tensor]]) -> None:
    assert kv.batch == len(tokens)
    for layer in range(LAYERS):
        assert kv.keys[layer].shape == (kv.batch, HEADS, kv.length, DIM)
        padding = (kv.mask == 0)[:, None, :, None]
        assert not kv.keys[layer].masked_select(padding).any()
        assert not kv.values[layer].masked_select(padding).any()
    for row, own in enumerate(tokens):
        keys, values = kv.row(row)
        assert keys[0].shape[1] == len(own)
        for layer in range(LAYERS):
            want = torch.stack([t[layer, 0] for t in own], dim=1)  # (H, n, D)
            assert torch.equal(keys[layer], want)
            assert torch.equal(values[layer], torch.stack([t[layer, 1] for t in own], dim=1))


def test_rows_joining_leaving_and_growing_read_their_own_tokens():
    """Random joins (bursts of 1 to 6 prompts of 1 to 90 tokens, longer and shorter than the
    batch), leaves (any subset) and decode steps, over 300 events of three seeds: after each,
    every row's keys and values are its own tokens' exactly, and its padding is zeros."""
    for seed in range(3):
        rng = random.Random(seed)
        torch.manual_seed(seed)
        tokens: list[list[torch.Tensor]] = []
        kv = prefill([rng.randint(1, 40) for _ in range(3)], tokens)
        for _ in range(100):
            event = rng.random()
            if event < 0.2:
                joining: list[list[torch.Tensor]] = []
                new = prefill([rng.randint(1, 90) for _ in range(rng.randint(1, 6))], joining)
                kv = PaddedKV.concat(kv, new)
                tokens += joining
            elif event < 0.35 and kv.batch > 1:
                keep = sorted(rng.sample(range(kv.batch), rng.randint(1, kv.batch - 1)))
                order = fill_order(keep, kv.batch)
                assert sorted(order) == keep
                kv = kv.select(order)
                tokens = [tokens[i] for i in order]
            else:
                decode(kv, tokens)
            check(kv, tokens)


def test_rows_leave_and_join_inside_the_buffers():
    """Once a decode step made room, a leaving row's slot is filled by the last row and a join
    that fits goes into the spare rows: the buffers are the same tensors throughout, and only
    a decode step past the room (every ROOM columns) or a join past the spare rows makes new
    ones."""
    torch.manual_seed(0)
    tokens: list[list[torch.Tensor]] = []
    kv = prefill([5, 9, 7, 3], tokens)
    decode(kv, tokens)
    assert kv.buffers is not None
    buffers = kv.buffers[0][0]
    order = fill_order([0, 2, 3], 4)
    assert order == [0, 3, 2]  # row 1's slot takes row 3, row 2 stays
    kv = kv.select(order)
    tokens = [tokens[i] for i in order]
    joining: list[list[torch.Tensor]] = []
    kv = PaddedKV.concat(kv, prefill([4, 6], joining))
    tokens += joining
    decode(kv, tokens)
    check(kv, tokens)
    assert kv.buffers is not None and kv.buffers[0][0] is buffers
    for _ in range(ROOM):
        decode(kv, tokens)
    assert kv.buffers[0][0] is not buffers  # grown at the room's end, once
    check(kv, tokens)


def test_a_batch_left_with_few_rows_gives_its_buffers_back():
    """A batch whose rows fell under a quarter of its buffers' rows is copied into tensors of
    its own size: one long reply does not hold a whole burst's memory."""
    torch.manual_seed(0)
    tokens: list[list[torch.Tensor]] = []
    kv = prefill([4] * 40, tokens)
    decode(kv, tokens)
    assert kv.buffers is not None
    kv = kv.select([7])
    tokens = [tokens[7]]
    assert kv.buffers is None and kv.keys[0].shape[0] == 1
    check(kv, tokens)
    decode(kv, tokens)
    check(kv, tokens)


def test_fill_order_moves_only_rows_past_the_new_end():
    assert fill_order([0, 1, 2], 3) == [0, 1, 2]
    assert fill_order([1, 2, 3], 4) == [3, 1, 2]
    assert fill_order([0, 2, 4, 5], 6) == [0, 4, 2, 5]
    assert fill_order([5], 6) == [5]
