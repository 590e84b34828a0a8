"""JetStreamPublisher (broker/publisher.py): pipelined publishes answer and fail exactly as
``js.publish`` does, against a real nats-server."""

from __future__ import annotations

import asyncio

import nats.errors
import nats.js.errors
import pytest

from agentarium.broker import ERR_WRONG_LAST_SEQUENCE, JetStreamPublisher


async def test_many_in_flight_each_acked_in_its_own_future(js, nc):
    await js.add_stream(name="P", subjects=["p.>"])
    publisher = JetStreamPublisher(nc)
    acks = await asyncio.gather(*(publisher.publish(f"p.{i}", b"x%d" % i) for i in range(500)))
    assert sorted(a["seq"] for a in acks) == list(range(1, 501))
    assert {a["stream"] for a in acks} == {"P"} and publisher.in_flight == 0
    assert (await js.stream_info("P")).state.messages == 500
    await publisher.close()


async def test_errors_are_the_ones_js_publish_raises(js, nc):
    await js.add_stream(name="Q", subjects=["q.>"])
    publisher = JetStreamPublisher(nc, timeout_s=0.5)
    once = {"Nats-Expected-Last-Subject-Sequence": "0"}
    await publisher.publish("q.job1", b"first", once)
    with pytest.raises(nats.js.errors.APIError) as refused:
        await publisher.publish("q.job1", b"second", once)
    assert refused.value.err_code == ERR_WRONG_LAST_SEQUENCE
    with pytest.raises(nats.js.errors.APIError) as direct:  # the same refusal through nats-py
        await js.publish("q.job1", b"third", headers=once)
    assert type(direct.value) is type(refused.value)
    with pytest.raises(nats.js.errors.NoStreamResponseError):
        await publisher.publish("nowhere.at.all", b"x")
    await publisher.close()


async def test_no_answer_is_a_timeout_and_close_fails_the_rest(nc):
    async def never_acks(msg) -> None:
        pass

    await nc.subscribe("silent.>", cb=never_acks)  # a responder, so no 503; it never answers
    publisher = JetStreamPublisher(nc, timeout_s=0.2)
    with pytest.raises(nats.errors.TimeoutError):
        await publisher.publish("silent.a", b"x")
    pending = asyncio.ensure_future(publisher.publish("silent.b", b"x", timeout_s=30))
    while publisher.in_flight == 0:
        await asyncio.sleep(0)
    await publisher.close()
    with pytest.raises(nats.errors.ConnectionClosedError):
        await pending
