"""broker.read_tail: the newest messages of a stream after a position, for live views."""

from __future__ import annotations

import json

import pytest

from agentarium.broker import read_tail


@pytest.mark.nats_semantics
async def test_reads_the_newest_then_only_what_came_next(js, topology):
    subject = topology.metrics_subject("r1")
    for step in range(1, 11):
        await js.publish(subject, json.dumps({"step": step}).encode())

    first = await read_tail(js, topology.metrics_stream, last=4)
    assert [json.loads(m.data)["step"] for m in first.messages] == [7, 8, 9, 10]
    assert first.last_seq == 10

    nothing = await read_tail(js, topology.metrics_stream, last=4, after_seq=first.last_seq)
    assert nothing.messages == [] and nothing.last_seq == 10

    for step in range(11, 14):
        await js.publish(subject, json.dumps({"step": step}).encode())
    after = await read_tail(js, topology.metrics_stream, last=100, after_seq=first.last_seq)
    assert [json.loads(m.data)["step"] for m in after.messages] == [11, 12, 13]
    # every reader's consumer is gone once it returns
    assert [c async for c in _consumers(js, topology.metrics_stream)] == []


@pytest.mark.nats_semantics
async def test_a_filter_that_matches_nothing_moves_past_the_window(js, topology):
    await js.publish(topology.metrics_subject("a"), b"{}")
    tail = await read_tail(
        js, topology.metrics_stream, last=5, subject_filter=topology.metrics_subject("b")
    )
    assert tail.messages == [] and tail.last_seq == 1


async def test_an_empty_stream_reads_nothing(js, topology):
    tail = await read_tail(js, topology.dead_stream, last=20)
    assert tail.messages == [] and tail.last_seq == 0


async def _consumers(js, stream):
    for info in await js.consumers_info(stream):
        yield info.name
