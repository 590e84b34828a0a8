"""The trajectory collector: a durable pull consumer on TRAJECTORIES feeding one agent's buffer.

One consumer per agent of a run, ``trainer-<run>-<agent>``, filtered to
``<prefix>.trajectories.<run>.<agent>.*`` (nats-server 2.9 has no multi-filter consumers; a
trainer of several agents holds one Collector each, trainer/tasks.py):

- explicit acks, no delivery limit (``max_deliver = -1``): a trajectory waits in the buffer or
  in a not-yet-checkpointed step for as long as it takes, and is never dead-lettered;
- ``max_ack_pending`` above the buffer plus a checkpoint interval's worth of trained-but-unacked
  trajectories, or partial groups would block delivery of their own missing members;
- a generous ``ack_wait`` (5 min by default), with ``in_progress()`` on every unacked message
  every third of it.

Acks: validation, duplicate, late and undecodable trajectories at once; dropped groups (flat,
too small, all stale, timed out short) at once; used groups only when the trainer says a
checkpoint covers their step (``ack``), so a trainer killed at any moment loses nothing.

Start-up resets the consumer: it is deleted and created again from its ack floor + 1, so what
a killed trainer left unacked is delivered at once rather than after ``ack_wait``. Messages
above the floor that were acked already come back too; the buffer recognises them from the
checkpoints' job id lists (duplicates) or drops them again by the same rule. One trainer per
run: a second one would reset the first one's consumer. A durable of that name filtering other
subjects (another run and agent whose names meet on it) is refused, never reset. Where only the
one-agent trainer's old durable ``trainer-<run>`` exists with this agent's filter, its ack floor
is adopted and it is deleted, so an upgraded trainer does not replay the run.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import TypeVar

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from agentarium.broker import START_PATIENCE_S, Backoff, Topology, cancel_and_wait, patiently
from agentarium.schemas import SchemaError, Trajectory, check_name, decode

from .batch import refusal
from .config import TrainerConfig
from .errors import TrainerConfigError
from .groups import ACK_NOW, LATE, Group, GroupBuffer, Selection

log = structlog.get_logger("agentarium.trainer")
T = TypeVar("T")

# a failing fetch (broker restarting, connection lost) is retried after 0.2 s, 0.4 s, ... 5 s
FETCH_BACKOFF = Backoff(initial_s=0.2, max_s=5.0)


@dataclass(frozen=True, kw_only=True)
class CollectorConfig:
    run: str
    agent: str
    group_timeout_s: float = 600.0
    min_members: int = 2
    ack_wait_s: float = 300.0
    max_ack_pending: int = 20_000
    fetch_batch: int = 256
    fetch_timeout_s: float = 1.0
    prefetch_groups: int = 64  # stop pulling while this many complete groups wait
    overlong: str = "keep"  # GroupBuffer's: keep | filter | reward
    overlong_reward: float = 0.0
    start_patience_s: float = START_PATIENCE_S  # start-up requests wait out a busy broker

    def __post_init__(self) -> None:
        check_name(self.run, "run")
        check_name(self.agent, "agent")
        if self.ack_wait_s < 3:
            raise ValueError("ack_wait_s must be >= 3 (heartbeats go every third of it)")

    @classmethod
    def from_trainer(cls, config: TrainerConfig, agent: str) -> CollectorConfig:
        return cls(
            run=config.run,
            agent=agent,
            group_timeout_s=config.group_timeout_s,
            min_members=config.min_group_members,
            ack_wait_s=config.ack_wait_s,
            max_ack_pending=config.max_ack_pending,
            prefetch_groups=4 * config.groups_per_step,
            overlong=config.overlong,
            overlong_reward=config.overlong_reward,
        )

    @property
    def durable(self) -> str:
        return Topology().trainer_consumer(self.run, self.agent)  # no prefix in the name

    def consumer_config(self, topology: Topology, start_seq: int | None = None) -> ConsumerConfig:
        return ConsumerConfig(
            durable_name=self.durable,
            description=f"GRPO trainer for run {self.run}, agent {self.agent}",
            filter_subject=topology.trajectories_filter(self.run, self.agent),
            deliver_policy=DeliverPolicy.BY_START_SEQUENCE if start_seq else DeliverPolicy.ALL,
            opt_start_seq=start_seq or None,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            max_deliver=-1,
            max_ack_pending=self.max_ack_pending,
        )


async def wait_for_any(events: Iterable[asyncio.Event | None], *, timeout: float) -> None:
    """Return once one of ``events`` is set, or after ``timeout`` seconds (None: not waited on)."""
    waiters = [asyncio.create_task(e.wait()) for e in events if e is not None]
    try:
        await asyncio.wait(waiters, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()


class Collector:
    """Pulls trajectories in the background; ``take`` hands out groups, ``ack`` retires them."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology,
        config: CollectorConfig,
        *,
        seen: Iterable[str] = (),
        clock: Callable[[], float] = time.monotonic,
        vocab_size: int | None = None,
    ) -> None:
        self.js = js
        self.topology = topology
        self.config = config
        self.clock = clock
        self.buffer = GroupBuffer(
            group_timeout_s=config.group_timeout_s,
            min_members=config.min_members,
            seen=seen,
            task=config.agent,
            run=config.run,
            vocab_size=vocab_size,
            overlong=config.overlong,
            overlong_reward=config.overlong_reward,
        )
        self._psub: JetStreamContext.PullSubscription | None = None
        self._tasks: list[asyncio.Task] = []
        self._decided: list[str] = []  # acked without training, not yet in a checkpoint
        self._changed = asyncio.Event()  # the buffer gained something
        self._taken = asyncio.Event()  # groups left the buffer: room to pull again

    def __repr__(self) -> str:
        return f"<Collector {self.config.durable} {self.buffer!r}>"

    @property
    def counters(self):
        return self.buffer.counters

    async def start(self) -> None:
        """Create (or reset) this trainer's durable from where its predecessor's acks ended.

        Each request waits out a broker that is away for now (restarting, electing, or too
        loaded to answer within the request timeout), as every service's start-up does
        (broker/patience.py), and each is safe to repeat: a delete that finds nothing was done
        by a try whose answer was lost, and adding a consumer that exists with the same config
        returns it."""
        stream = self.topology.trajectories_stream
        durable = self.config.durable
        wanted = self.topology.trajectories_filter(self.config.run, self.config.agent)
        start_seq, adopted = None, None
        try:
            info = await self._patiently(
                lambda: self.js.consumer_info(stream, durable), "reading the trainer's consumer"
            )
            if info.config.filter_subject != wanted:
                raise TrainerConfigError(
                    f"consumer {durable} on {stream} filters {info.config.filter_subject}, not "
                    f"{wanted}: another run and agent share this durable name (names may hold "
                    "'-'); rename the run or the agent"
                )
            start_seq = info.ack_floor.stream_seq + 1 if info.ack_floor else None
            await self._delete_consumer(stream, durable)
        except nats.js.errors.NotFoundError:
            start_seq, adopted = await self._legacy_floor(stream, wanted)
        consumer = self.config.consumer_config(self.topology, start_seq)
        await self._patiently(
            lambda: self.js.add_consumer(stream, consumer), "creating the trainer's consumer"
        )
        if adopted is not None:
            await self._delete_consumer(stream, adopted)
        self._psub = await self.js.pull_subscribe_bind(durable, stream)
        log.info(
            "collector started",
            consumer=durable,
            filter=consumer.filter_subject,
            start_seq=start_seq,
            adopted=adopted,
            ack_wait_s=consumer.ack_wait,
            max_ack_pending=consumer.max_ack_pending,
        )
        self._tasks = [
            asyncio.create_task(self._pull_loop()),
            asyncio.create_task(self._heartbeat_loop()),
        ]

    async def _patiently(self, call: Callable[[], Awaitable[T]], what: str) -> T:
        return await patiently(call, patience_s=self.config.start_patience_s, what=what)

    async def _delete_consumer(self, stream: str, durable: str) -> None:
        async def once() -> None:
            try:
                await self.js.delete_consumer(stream, durable)
            except nats.js.errors.NotFoundError:  # gone: a try whose answer was lost did it
                pass

        await self._patiently(once, f"deleting consumer {durable}")

    async def _legacy_floor(self, stream: str, wanted: str) -> tuple[int | None, str | None]:
        """The start sequence and name of the one-agent trainer's durable, if it was ours."""
        legacy = self.topology.legacy_trainer_consumer(self.config.run)
        try:
            info = await self._patiently(
                lambda: self.js.consumer_info(stream, legacy), "reading the old trainer consumer"
            )
        except nats.js.errors.NotFoundError:
            return None, None
        if info.config.filter_subject != wanted:
            return None, None
        return (info.ack_floor.stream_seq + 1 if info.ack_floor else None), legacy

    async def close(self) -> None:
        """Stop pulling; unacked messages stay with the consumer for the next trainer."""
        await cancel_and_wait(self._tasks)  # a fetch may swallow one cancel (broker/aio.py)
        self._tasks = []
        if self._psub is not None:
            try:
                await self._psub.unsubscribe()
            except Exception:  # a closed connection: nothing left to release
                pass
            self._psub = None

    async def take(
        self,
        n: int,
        selection: Selection,
        *,
        stop: asyncio.Event | None = None,
        timeout: float | None = None,
    ) -> list[Group] | None:
        """Wait for n usable groups (oldest first). None if ``stop`` was set first; on
        ``timeout`` a TimeoutError, the groups gathered so far going back to the buffer."""
        deadline = None if timeout is None else time.monotonic() + timeout
        chosen: list[Group] = []
        while True:
            self._changed.clear()
            chosen += await self.gather(n - len(chosen), selection)
            if len(chosen) == n:
                return chosen
            if stop is not None and stop.is_set():
                self.buffer.requeue(chosen)
                return None
            wait = self.config.fetch_timeout_s
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
                if wait <= 0:
                    self.buffer.requeue(chosen)
                    raise TimeoutError(f"{len(chosen)} of {n} groups ready: {self!r}")
            await wait_for_any([self._changed, stop], timeout=wait)

    async def gather(self, n: int, selection: Selection) -> list[Group]:
        """Up to n usable groups now, without waiting: expired and dropped groups are acked on
        the way."""
        await self._ack_dropped(self.buffer.expire(self.clock()))
        if n <= 0:
            return []
        got, dropped = self.buffer.select(n, selection)
        await self._ack_dropped(dropped)
        if got or dropped:
            self._taken.set()
        return got

    @property
    def changed(self) -> asyncio.Event:
        """Set when the buffer gained something; clear it before looking at the buffer."""
        return self._changed

    async def wait_received(self, n: int, *, timeout: float = 30.0) -> None:
        """Wait until n trajectories have been delivered (tests, progress displays)."""
        async with asyncio.timeout(timeout):
            while self.buffer.counters.received < n:
                self._changed.clear()
                await self._changed.wait()

    async def ack(self, groups: list[Group]) -> None:
        """Ack every member of groups a checkpoint now covers (waiting for the server)."""
        await self._ack_all([h for g in groups for h in g.handles])
        self.buffer.done(groups)

    async def _ack_dropped(self, groups: list[Group]) -> None:
        if groups:
            self._decided.extend(j for g in groups for j in g.members)
            await self.ack(groups)

    def take_decided(self) -> list[str]:
        """Job ids acked without training since the last call (dropped groups, late members),
        for the next checkpoint: a restarted trainer replays from the ack floor and must not
        judge them again."""
        decided, self._decided = self._decided, []
        return decided

    async def _ack_all(self, msgs: list[Msg]) -> None:
        for start in range(0, len(msgs), 256):
            chunk = msgs[start : start + 256]
            results = await asyncio.gather(
                *(m.ack_sync(timeout=5.0) for m in chunk), return_exceptions=True
            )
            failed = [r for r in results if isinstance(r, BaseException)]
            if failed:
                # The message comes back after ack_wait and is recognised as a duplicate.
                log.warning("acks failed", failed=len(failed), error=str(failed[0]))

    async def _pull_loop(self) -> None:
        cfg = self.config
        psub = self._psub
        assert psub is not None, "start() subscribes before it starts the pull loop"
        errors_in_row = 0
        while True:
            if self.buffer.ready_count >= cfg.prefetch_groups:
                self._taken.clear()
                try:
                    await asyncio.wait_for(self._taken.wait(), timeout=cfg.fetch_timeout_s)
                except TimeoutError:
                    pass
                continue
            try:
                msgs = await psub.fetch(cfg.fetch_batch, timeout=cfg.fetch_timeout_s)
                errors_in_row = 0
            except TimeoutError:  # nothing arrived (nats' TimeoutError is a subclass)
                msgs = []
            except (nats.errors.Error, nats.js.errors.Error, OSError) as exc:
                errors_in_row += 1
                log.warning("trajectory fetch failed; retrying", error=str(exc) or repr(exc))
                await asyncio.sleep(FETCH_BACKOFF.delay(errors_in_row))
                continue
            for msg in msgs:
                await self._receive(msg)
            await self._ack_dropped(self.buffer.expire(self.clock()))
            if msgs:
                self._changed.set()

    async def _receive(self, msg: Msg) -> None:
        headers = msg.headers or {}
        try:
            trajectory = decode(Trajectory, msg.data, headers.get("Content-Type"))
        except SchemaError as exc:
            self.buffer.counters.received += 1
            self.buffer.counters.invalid += 1
            log.warning(
                "undecodable trajectory acked and skipped", subject=msg.subject, error=str(exc)
            )
            await _ack_quietly(msg)
            return
        refused = self.buffer.counters.refused
        outcome = self.buffer.add(trajectory, msg, self.clock())
        if outcome == LATE:
            self._decided.append(trajectory.job_id)
        if outcome in ACK_NOW:
            await _ack_quietly(msg)
        elif self.buffer.counters.refused > refused and _power_of_ten(refused + 1):
            log.warning(
                "trajectory kept out of training (sampling it cannot reproduce: use "
                "temperature > 0, top_p 1 and top_k -1; or data a step cannot use)",
                job_id=trajectory.job_id,
                reason=refusal(trajectory, self.buffer.vocab_size),
                refused_so_far=refused + 1,
            )

    async def _heartbeat_loop(self) -> None:
        """in_progress() on every unacked message, so nothing is redelivered while it waits."""
        period = self.config.ack_wait_s / 3
        while True:
            await asyncio.sleep(period)
            for msg in self.buffer.live_handles():
                try:
                    await msg.in_progress()
                except Exception as exc:  # a lost heartbeat risks only a redelivery (deduped)
                    log.debug("heartbeat failed", error=str(exc))


def _power_of_ten(n: int) -> bool:
    """Log the 1st, 10th, 100th... occurrence: visible, without flooding."""
    while n % 10 == 0:
        n //= 10
    return n == 1


async def _ack_quietly(msg: Msg) -> None:
    try:
        await msg.ack()
    except Exception as exc:  # redelivered later and acked again by the same rule
        log.debug("ack failed", error=str(exc))
