"""TrajectoryReader: read back the trajectories of a run, all at once or as they arrive.

Reads go through a short-lived ephemeral pull consumer (no acks, in memory, deleted when
done) filtered on ``<prefix>.trajectories.<run>.<agent>.*``. Pull requests ask for a few
hundred messages at a time, and every message says how many are still pending, so
``read`` stops the moment it has caught up: an empty run costs one consumer creation,
never a timeout. ``follow`` keeps a lingering pull request open and yields each
trajectory as it lands; ``wait_for`` is ``follow`` with a finish line.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from agentarium.broker import ERR_STREAM_NOT_FOUND, TRANSIENT_NATS_ERRORS, Topology
from agentarium.schemas import STATUSES, SchemaError, Trajectory, decode

from .errors import StreamMissing

log = structlog.get_logger("agentarium.producers")

BATCH = 256
CREATE_ATTEMPTS = 12  # about 15 s of retries while a stream elects a leader
RETRYABLE: tuple[type[Exception], ...] = (
    *TRANSIENT_NATS_ERRORS,
    nats.js.errors.ServiceUnavailableError,  # 503: JetStream (or the stream) not ready yet
)
EXPIRES_S = 5.0  # a lingering pull request lives this long; the server answers 408 at the end
SILENCE_S = EXPIRES_S + 3.0  # no answer at all by then: the request (or consumer) was lost
INACTIVE_S = 120.0  # the server deletes a reader's consumer this long after the reader vanished
# A read waits at most this long for a replica that is catching up (see _replicas_current).
REPLICA_WAIT_S = 15.0

_STATUS_DONE = {
    "404",
    "408",
    "409",
}  # no messages / request expired / request ended (e.g. consumer deleted)


class _Cursor:
    """One ephemeral consumer and the inbox its messages arrive on."""

    def __init__(self, js: JetStreamContext, stream: str, subject_filter: str, batch: int) -> None:
        self.js = js
        self.nc = js._nc  # nats-py keeps no public handle on its connection
        self.api = getattr(js, "_prefix", "$JS.API")
        self.stream = stream
        self.filter = subject_filter
        self.batch = batch
        self.name = ""
        self.last_seq = 0
        self.pending = 0
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub: Any = None
        self._inbox = ""

    async def open(self) -> int:
        async def on_msg(msg: Msg) -> None:
            self._queue.put_nowait(msg)

        self._inbox = self.nc.new_inbox()
        self._sub = await self.nc.subscribe(self._inbox, cb=on_msg)
        await self._create()
        return self.pending

    async def _create(self) -> None:
        start = (
            {"deliver_policy": DeliverPolicy.BY_START_SEQUENCE, "opt_start_seq": self.last_seq + 1}
            if self.last_seq
            else {"deliver_policy": DeliverPolicy.ALL}
        )
        delay = 0.2
        for attempt in range(1, CREATE_ATTEMPTS + 1):
            try:
                info = await self.js.add_consumer(self.stream, self._config(start))
                break
            except nats.js.errors.NotFoundError as exc:
                raise StreamMissing(
                    f"stream {self.stream} does not exist: run `agentarium broker init` (or broker.provision) first"
                ) from exc
            except RETRYABLE as exc:
                # A stream whose leader was just lost answers nothing until one is elected.
                if attempt == CREATE_ATTEMPTS:
                    raise
                log.info(
                    "trajectory reader: the stream is not answering yet; retrying",
                    stream=self.stream,
                    attempt=attempt,
                    error=str(exc) or type(exc).__name__,
                )
                await asyncio.sleep(delay)
                delay = min(2.0, delay * 2)
        self.name = info.name
        self.pending = info.num_pending or 0

    def _config(self, start: dict[str, Any]) -> ConsumerConfig:
        return ConsumerConfig(
            ack_policy=AckPolicy.NONE,
            filter_subject=self.filter,
            inactive_threshold=INACTIVE_S,
            mem_storage=True,
            description="agentarium trajectory reader",
            **start,
        )

    async def close(self) -> None:
        with contextlib.suppress(Exception):  # best effort: the inactive threshold cleans up anyway
            if self._sub is not None:
                await self._sub.unsubscribe()
        if self.name and not self.nc.is_closed:
            with contextlib.suppress(Exception):
                await self.js.delete_consumer(self.stream, self.name)

    async def _request(self, batch: int) -> None:
        body = {"batch": batch, "expires": int(EXPIRES_S * 1e9)}
        await self.nc.publish(
            f"{self.api}.CONSUMER.MSG.NEXT.{self.stream}.{self.name}",
            json.dumps(body).encode(),
            reply=self._inbox,
        )

    async def _recover(self) -> None:
        """A request went unanswered or was cut short: is our consumer still there?"""
        try:
            info = await self.js.consumer_info(self.stream, self.name)
            self.pending = info.num_pending or 0
        except nats.js.errors.NotFoundError:
            log.info(
                "trajectory reader consumer vanished: recreating it",
                stream=self.stream,
                after_seq=self.last_seq,
            )
            await self._create()

    async def _try_recover(self) -> None:
        # A broker still restarting answers nothing useful yet: the next round tries again.
        with contextlib.suppress(nats.errors.Error, asyncio.TimeoutError):
            await self._recover()

    async def messages(self, *, until_caught_up: bool) -> AsyncIterator[Msg]:
        """Raw messages in stream order; ``until_caught_up`` stops once nothing is pending."""
        outstanding = 0
        while True:
            if until_caught_up and self.pending == 0:
                return
            if outstanding <= 0:  # a late reply from an older request can push it below zero
                outstanding = min(self.batch, self.pending) if until_caught_up else self.batch
                try:
                    await self._request(outstanding)
                except (
                    nats.errors.OutboundBufferLimitError,
                    nats.errors.ConnectionReconnectingError,
                ):
                    # Reconnecting with a full outgoing buffer: no event to await, so wait a bit.
                    outstanding = 0
                    await asyncio.sleep(0.5)
                    continue
            try:
                msg = self._queue.get_nowait()
            except asyncio.QueueEmpty:
                try:
                    async with asyncio.timeout(SILENCE_S):
                        msg = await self._queue.get()
                except TimeoutError:
                    outstanding = 0
                    await self._try_recover()
                    continue
            status = msg.headers.get("Status") if msg.headers else None
            if status is not None:
                if status in _STATUS_DONE:
                    outstanding = 0
                    if (
                        status == "409"
                    ):  # the request was cut short (consumer deleted, leader change)
                        await self._try_recover()
                    elif until_caught_up:
                        return  # it expired unfilled: nothing more is stored right now
                continue  # 100 = idle heartbeat
            outstanding -= 1
            meta = msg.metadata
            self.last_seq = meta.sequence.stream
            self.pending = meta.num_pending
            yield msg


class TrajectoryReader:
    """Reads trajectories from the TRAJECTORIES stream. ``skipped`` counts undecodable ones."""

    def __init__(
        self, js: JetStreamContext, topology: Topology | None = None, *, batch: int = BATCH
    ) -> None:
        if batch < 1:
            raise ValueError("batch must be >= 1")
        self.js = js
        self.topology = topology or Topology()
        self.batch = batch
        self.skipped = 0

    def __repr__(self) -> str:
        return f"<TrajectoryReader prefix={self.topology.prefix!r} skipped={self.skipped}>"

    def decode(self, data: bytes | None, headers: dict | None, subject: str) -> Trajectory | None:
        """A stored message as a Trajectory; None (counted in ``skipped``, logged) if undecodable."""
        try:
            return decode(Trajectory, data or b"", (headers or {}).get("Content-Type"))
        except SchemaError as exc:
            self.skipped += 1
            log.warning(
                "skipping an undecodable trajectory",
                subject=subject,
                error=str(exc),
                skipped=self.skipped,
            )
            return None

    async def _trajectories(
        self, run: str, agent: str, *, until_caught_up: bool
    ) -> AsyncGenerator[Trajectory, None]:
        subject_filter = self.topology.trajectories_filter(run, agent)
        expected = None
        if until_caught_up:
            await self._replicas_current()
            expected = await self._stored_on_leader(subject_filter)
        cursor = _Cursor(self.js, self.topology.trajectories_stream, subject_filter, self.batch)
        seen, deadline = 0, time.monotonic() + REPLICA_WAIT_S
        try:
            await cursor.open()
            while True:
                async for msg in cursor.messages(until_caught_up=until_caught_up):
                    seen += 1
                    trajectory = self.decode(msg.data, msg.headers, msg.subject)
                    if trajectory is not None:
                        yield trajectory
                if expected is None or seen >= expected:
                    return
                if time.monotonic() > deadline:
                    log.warning(
                        "trajectory reader: read fewer messages than the stream leader holds",
                        read=seen,
                        stored=expected,
                        waited_s=REPLICA_WAIT_S,
                    )
                    return
                # The cursor's replica had not applied everything the leader holds (a
                # replica reported current has received the entries, not always applied
                # them): read on from where it stopped, on a new cursor.
                await cursor.close()
                await asyncio.sleep(0.2)
                await cursor.open()
        finally:
            await cursor.close()

    async def _stored_on_leader(self, subject_filter: str) -> int | None:
        """In a cluster, how many messages under the filter the stream's leader holds (its
        info is the leader's); None on a single server or when it does not answer."""
        try:
            info = await self.js.stream_info(
                self.topology.trajectories_stream, subjects_filter=subject_filter
            )
        except nats.errors.Error:
            return None
        if not (info.cluster and info.cluster.replicas):
            return None
        return sum((info.state.subjects or {}).values())

    async def _replicas_current(self) -> None:
        """In a cluster, the reader's ephemeral consumer may be placed on a replica that is
        still catching up (a node just restarted); a read that stops once that consumer has
        nothing pending would then stop at that replica's end and come up short. So a read
        first waits, at most REPLICA_WAIT_S, until every replica that is online is current
        (an offline one holds no consumer). One stream info; nothing on a single server."""
        deadline = time.monotonic() + REPLICA_WAIT_S
        while True:
            try:
                info = await self.js.stream_info(self.topology.trajectories_stream)
            except nats.errors.Error:
                return  # missing or not answering: the cursor reports or rides it out
            behind = [
                r.name for r in (info.cluster.replicas if info.cluster else None) or []
                if not (r.current or r.offline)
            ]  # fmt: skip
            if not behind:
                return
            if time.monotonic() > deadline:
                log.warning(
                    "trajectory reader: replicas still catching up; the read may miss the "
                    "newest trajectories",
                    replicas=behind,
                    waited_s=REPLICA_WAIT_S,
                )
                return
            await asyncio.sleep(0.2)

    async def read(
        self, run: str, agent: str = "*", *, status: str | None = None
    ) -> list[Trajectory]:
        """Every trajectory stored so far for ``run`` (and ``agent``), in stream order."""
        if status is not None and status not in STATUSES:
            raise ValueError(f"status {status!r} is not one of {STATUSES}")
        out = []
        async with contextlib.aclosing(
            self._trajectories(run, agent, until_caught_up=True)
        ) as stream:
            async for trajectory in stream:
                if status is None or trajectory.status == status:
                    out.append(trajectory)
        return out

    async def follow(self, run: str, agent: str = "*") -> AsyncGenerator[Trajectory, None]:
        """Everything stored, then each new trajectory as it lands, until the caller stops."""
        async with contextlib.aclosing(
            self._trajectories(run, agent, until_caught_up=False)
        ) as stream:
            async for trajectory in stream:
                yield trajectory

    async def get(self, run: str, agent: str, job_id: str) -> Trajectory | None:
        """The trajectory of one job, or None if it is not stored (or cannot be decoded)."""
        subject = self.topology.trajectory_subject(run, agent, job_id)
        try:
            raw = await self.js.get_last_msg(self.topology.trajectories_stream, subject)
        except nats.js.errors.NotFoundError as exc:
            if exc.err_code == ERR_STREAM_NOT_FOUND:
                raise StreamMissing(
                    f"stream {self.topology.trajectories_stream} does not exist: run `agentarium broker init` first"
                ) from exc
            return None
        return self.decode(raw.data, raw.headers, subject)

    async def wait_for(
        self,
        run: str,
        job_ids: Collection[str],
        *,
        agent: str = "*",
        timeout: float | None = None,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, Trajectory]:
        """Wait until every job in ``job_ids`` has a trajectory; returns them by job id.

        Raises TimeoutError saying how many are missing when ``timeout`` seconds pass first.
        """
        wanted = set(job_ids)
        found: dict[str, Trajectory] = {}
        if not wanted:
            return found
        started = time.monotonic()
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                async with contextlib.aclosing(self.follow(run, agent)) as stream:
                    async for trajectory in stream:
                        if trajectory.job_id in wanted and trajectory.job_id not in found:
                            found[trajectory.job_id] = trajectory
                            if on_progress is not None:
                                on_progress(len(found), len(wanted))
                            if len(found) == len(wanted):
                                break
        except TimeoutError:
            if not deadline.expired():
                raise  # a broker request timed out inside: not the caller's deadline
            missing = len(wanted) - len(found)
            raise TimeoutError(
                f"{missing} of {len(wanted)} trajectories of run {run!r} still missing after "
                f"{time.monotonic() - started:.1f}s: are consumers running for agent {agent!r}?"
            ) from None
        return found
