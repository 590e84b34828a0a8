"""The newest messages of a stream, read with a short-lived ephemeral consumer.

Live views poll: each call reads at most ``last`` messages stored after ``after_seq`` (the
newest ones when more arrived), through an in-memory consumer without acks that is deleted
at once (its inactive threshold removes it if this process dies first). Positions are stream
sequences, so a caller keeps the returned ``last_seq`` and asks again for what came next.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

INACTIVE_S = 30.0
FETCH_TIMEOUT_S = 5.0


@dataclass
class Tail:
    """What one read found: the messages in stream order, and the newest sequence read."""

    messages: list[Msg] = field(default_factory=list)
    last_seq: int = 0


async def read_tail(
    js: JetStreamContext,
    stream: str,
    *,
    last: int,
    after_seq: int = 0,
    subject_filter: str | None = None,
) -> Tail:
    """Up to ``last`` of the newest messages stored after ``after_seq``.

    The window is counted in stream sequences, so with a ``subject_filter`` that does not cover
    the whole stream it may hold fewer than ``last`` matching messages. Raises
    ``nats.js.errors.NotFoundError`` when the stream does not exist.
    """
    if last < 1:
        raise ValueError("last must be >= 1")
    state = (await js.stream_info(stream)).state
    if state.last_seq <= after_seq or state.messages == 0:
        return Tail(last_seq=max(after_seq, state.last_seq))
    start = max(after_seq + 1, state.last_seq - last + 1, state.first_seq)
    config = ConsumerConfig(
        deliver_policy=DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=start,
        ack_policy=AckPolicy.NONE,
        filter_subject=subject_filter,
        mem_storage=True,
        inactive_threshold=INACTIVE_S,
        description="agentarium tail reader",
    )
    info = await js.add_consumer(stream, config)
    tail = Tail(last_seq=start - 1)
    sub = None
    try:
        wanted = min(info.num_pending or 0, last)
        if wanted:
            sub = await js.pull_subscribe_bind(consumer=info.name, stream=stream)
            # One deadline for the whole read: messages counted but gone by now (max age) or a
            # slow broker cut it short; what was read is returned and the next read goes on.
            deadline = time.monotonic() + FETCH_TIMEOUT_S
            while len(tail.messages) < wanted and (left := deadline - time.monotonic()) > 0:
                try:
                    got = await sub.fetch(wanted - len(tail.messages), timeout=left)
                except (nats.errors.TimeoutError, TimeoutError):
                    break
                if not got:
                    break
                tail.messages.extend(got)
        if tail.messages:
            tail.last_seq = tail.messages[-1].metadata.sequence.stream
        else:  # nothing matched the filter in the window: skip past it next time
            tail.last_seq = max(tail.last_seq, state.last_seq)
    finally:
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        with contextlib.suppress(nats.errors.Error, nats.js.errors.Error):
            await js.delete_consumer(stream, info.name)
    return tail
