"""The pipelined publish: many jobs in flight, each acked, retried or refused on its own.

One loop sends each job as a core NATS publish whose reply subject is a token under one
inbox of ours; JetStream answers every publish there with its PubAck or its error. Up to
``max_in_flight`` jobs hold a slot; a job keeps its slot from its first send until it is
stored (or refused), through every backoff, so a full stream slows the sender down instead
of piling up retries. A single deadline watcher fails the oldest publish once its ack is
overdue, which becomes a retry like any other timeout.

Why not nats-py's ``publish_async``: its reply handler raises instead of failing the
future when JetStream answers with an error (a full stream, err 10077), so the error
code never reaches the caller. Why not ``js.publish`` calls under a semaphore: a task,
a timer and a ``wait_for`` per job make that ~2.5x slower (bench/publish.py).
"""

from __future__ import annotations

import asyncio
import collections
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from agentarium.broker import OPENINFERENCE_SPAN_KIND, inject_headers
from agentarium.schemas import MSGPACK, Job

from .errors import ProducerError, StreamMissing
from .retry import PublishOutcome, classify

if TYPE_CHECKING:
    from .sdk import TaskProducer

tracer = trace.get_tracer("agentarium.producers")


@dataclass(eq=False)
class Entry:
    job: Job
    subject: str
    payload: bytes
    headers: dict[str, str] = field(default_factory=dict)
    span: Span | None = None
    token: str = ""
    attempt: int = 0
    sent_at: float = 0.0
    maybe_stored: bool = False  # an earlier attempt's ack was lost: it may have landed


def parse_reply(msg: Msg) -> tuple[BaseException | None, bool]:
    """A JetStream publish reply: ``(error, duplicate)``, errors as nats-py's exception types."""
    headers = msg.headers or {}
    status = headers.get("Status")
    if status == "503":
        return nats.js.errors.NoStreamResponseError(), False
    if status:
        return nats.js.errors.APIError(
            code=int(status), description=headers.get("Description")
        ), False
    try:
        reply = json.loads(msg.data)
    except ValueError:
        return nats.js.errors.APIError(
            description=f"unreadable publish ack: {msg.data[:80]!r}"
        ), False
    error = reply.get("error")
    if error is not None:
        return nats.js.errors.APIError(
            code=error.get("code"),
            err_code=error.get("err_code"),
            description=error.get("description"),
        ), False
    return None, bool(reply.get("duplicate"))


class Pipeline:
    """Publishes ``entries`` once; ``await run()`` returns ``(published, duplicates)``."""

    def __init__(
        self,
        producer: TaskProducer,
        entries: Sequence[Entry],
        parent: otel_context.Context,
        on_progress: Callable[[int, int], None] | None,
    ) -> None:
        self.p = producer
        self.nc = producer.nc
        self.entries = entries
        self.parent = parent
        self.on_progress = on_progress
        self.published = 0
        self.duplicates = 0
        self.sent = 0
        self.error: BaseException | None = None
        self.inflight: dict[str, Entry] = {}  # by reply token; insertion order = send order
        self.ready: collections.deque[Entry] = collections.deque()  # backed off, due again
        self.wake = asyncio.Event()
        self.holding: set[Entry] = set()  # jobs holding a slot: in flight or backing off
        self.timers: dict[Entry, asyncio.TimerHandle] = {}
        self.tasks: set[asyncio.Task] = set()
        self.loop = asyncio.get_running_loop()
        self.inbox = ""

    async def run(self) -> tuple[int, int]:
        self.inbox = self.nc.new_inbox() + "."
        sub = await self.nc.subscribe(self.inbox + "*", cb=self._on_reply)
        watcher = asyncio.ensure_future(self._watch_deadlines())
        fresh = iter(self.entries)
        exhausted = False
        try:
            while self.error is None:
                self.wake.clear()
                if self.ready:
                    await self._send(self.ready.popleft())
                    continue
                if not exhausted and len(self.holding) < self.p.max_in_flight:
                    entry = next(fresh, None)
                    if entry is not None:
                        self.holding.add(entry)
                        await self._send(entry)
                        continue
                    exhausted = True
                if exhausted and not self.holding:
                    break
                await self.wake.wait()
        finally:
            watcher.cancel()
            self._abandon()
            if not self.nc.is_closed:
                try:
                    await sub.unsubscribe()
                except nats.errors.Error:
                    pass  # reconnecting or closing: the subscription goes with the connection
        if self.error is not None:
            raise self.error
        return self.published, self.duplicates

    # sending and acks

    async def _send(self, entry: Entry) -> None:
        if entry.span is None:
            job = entry.job
            entry.span = tracer.start_span(
                "publish tasks",
                context=self.parent,
                kind=SpanKind.PRODUCER,
                attributes={
                    "messaging.system": "nats",
                    "messaging.destination.name": entry.subject,
                    "messaging.message.id": job.job_id,
                    "messaging.operation": "publish",
                    "agentarium.batch_id": job.batch_id,
                    "agentarium.run": job.run,
                    OPENINFERENCE_SPAN_KIND: "CHAIN",
                },
            )
            entry.headers = inject_headers(
                MSGPACK.headers({"Nats-Msg-Id": job.job_id}),
                trace.set_span_in_context(entry.span),
            )
        self.sent += 1
        entry.token = str(self.sent)
        entry.sent_at = time.monotonic()
        self.inflight[entry.token] = entry
        try:
            await self.nc.publish(
                entry.subject, entry.payload, reply=self.inbox + entry.token, headers=entry.headers
            )
        except Exception as exc:  # noqa: BLE001 - classified in _failed
            if self.inflight.pop(entry.token, None) is not None:
                self._failed(entry, exc)

    async def _on_reply(self, msg: Msg) -> None:
        entry = self.inflight.pop(msg.subject[len(self.inbox) :], None)
        if entry is None:
            return  # the answer to an attempt we already gave up on
        exc, duplicate = parse_reply(msg)
        if exc is not None:
            self._failed(entry, exc)
            return
        duplicate = duplicate and not entry.maybe_stored
        if duplicate:
            self.duplicates += 1
        else:
            self.published += 1
        self._finish(entry, duplicate=duplicate)
        if self.on_progress is not None and self.error is None:
            try:
                self.on_progress(self.published + self.duplicates, len(self.entries))
            except Exception as cb_exc:  # noqa: BLE001 - the caller's callback: surface it from run()
                self.error = cb_exc

    def _failed(self, entry: Entry, exc: BaseException) -> None:
        if self.nc.is_closed:
            return self._give_up(entry, self.p.closed_error(entry.job), exc)
        outcome = classify(exc)
        if outcome is PublishOutcome.FATAL:
            return self._give_up(entry, self.p.fatal_error(entry.job, entry.subject, exc), exc)
        entry.maybe_stored = entry.maybe_stored or outcome is PublishOutcome.UNAVAILABLE
        entry.attempt += 1
        if outcome is PublishOutcome.NO_STREAM:
            task = self.loop.create_task(self._check_stream_then_retry(entry, exc))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)
            return
        self._retry_later(entry, outcome, exc)

    def _retry_later(self, entry: Entry, outcome: PublishOutcome, exc: BaseException) -> None:
        delay = self.p.note_retry(outcome, entry.subject, exc, entry.attempt)
        if entry.span is not None:
            entry.span.add_event(
                "retry", {"reason": outcome.value, "attempt": entry.attempt, "delay_s": delay}
            )
        self.timers[entry] = self.loop.call_later(delay, self._due, entry)

    def _due(self, entry: Entry) -> None:
        self.timers.pop(entry, None)
        self.ready.append(entry)
        self.wake.set()

    async def _check_stream_then_retry(self, entry: Entry, exc: BaseException) -> None:
        try:
            await self.p.check_stream(entry.job)
        except StreamMissing as missing:
            self._give_up(entry, missing, exc)
            return
        self._retry_later(entry, PublishOutcome.NO_STREAM, exc)

    def _give_up(self, entry: Entry, error: ProducerError, cause: BaseException) -> None:
        error.__cause__ = cause
        if self.error is None:
            self.error = error
        self._finish(entry, error=error)

    def _finish(
        self, entry: Entry, *, duplicate: bool = False, error: BaseException | None = None
    ) -> None:
        self.holding.discard(entry)
        if entry.span is not None:
            if entry.attempt:
                entry.span.set_attribute("agentarium.publish_attempts", entry.attempt + 1)
            if error is not None:
                entry.span.set_status(Status(StatusCode.ERROR, str(error)))
            else:
                entry.span.set_attribute("agentarium.duplicate", duplicate)
            entry.span.end()
            entry.span = None
        self.wake.set()

    # deadlines and cleanup

    async def _watch_deadlines(self) -> None:
        """Fail publishes whose ack is overdue, oldest first (dict order is send order)."""
        timeout = self.p.ack_timeout_s
        while True:
            if not self.inflight:
                await asyncio.sleep(
                    timeout / 4
                )  # idle: a new publish is at most this late to be watched
                continue
            token, entry = next(iter(self.inflight.items()))
            wait = entry.sent_at + timeout - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
                continue
            del self.inflight[token]
            self._failed(entry, TimeoutError(f"no publish ack within {timeout}s"))

    def _abandon(self) -> None:
        """On error or cancellation: stop timers and checks, end the spans still open."""
        for handle in self.timers.values():
            handle.cancel()
        for task in self.tasks:
            task.cancel()
        self.inflight.clear()
        for entry in self.holding:
            if entry.span is not None:
                entry.span.set_status(Status(StatusCode.ERROR, "abandoned"))
                entry.span.end()
                entry.span = None
