"""TrajectoryStore: a rollout's trajectory stored exactly once, or the job as a dead letter.

Exactly once rests on the server, not on timing: a trajectory is published to its per-job
subject with ``Nats-Expected-Last-Subject-Sequence: 0``, so a second one for the same job
(a redelivery, a retry after a lost publish ack) is refused with err 10071 whatever the time
since. Transient failures (a restarting broker, a leader election) are retried until the
message lands; the job stays in flight, heartbeated, meanwhile.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TypeVar

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from agentarium.broker import (
    ERR_WRONG_LAST_SEQUENCE,
    TRANSIENT_NATS_ERRORS,
    Backoff,
    JetStreamPublisher,
    Topology,
    trajectory_stored,
)
from agentarium.schemas import MSGPACK, DeadLetter, Encoding, Job, Trajectory

log = structlog.get_logger("agentarium.consumers")

T = TypeVar("T")

BACKOFF = Backoff(initial_s=0.1, max_s=5.0)  # between two tries of a store call
# A dead letter keeps at most this much of an undecodable payload (base64 grows it by 4/3 and
# the server's max_payload is 1 MiB by default).
MAX_RAW_BYTES = 64 * 1024
DEFAULT_MAX_PAYLOAD = 1024 * 1024  # nats-server's default, when the client does not say
# An error text in a message that had to be cut down to fit max_payload keeps this much.
FITTED_ERROR_CHARS = 4_000
PAYLOAD_MEMO = 1024
# A requeued job's header: how many times drains released it (logs and dead letters show it;
# its presence tells the next worker to look for a stored trajectory first).
RELEASES_HEADER = "Agentarium-Releases"


def releases(msg: Msg) -> int:
    """How many times drains released this job before (0 for a job as its producer sent it)."""
    try:
        return int((msg.headers or {}).get(RELEASES_HEADER, 0))
    except ValueError:
        return 0


def _server_side(exc: nats.js.errors.APIError) -> bool:
    """Whether JetStream refused for its own trouble (5xx, 503), which passes, rather than for
    the request's (4xx), which a retry would only repeat."""
    return not (exc.code and exc.code < 500 and exc.code != 503)


async def _until_done(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``await call()`` until it returns, waiting out transient failures with capped backoff.

    The job stays in flight (heartbeated) meanwhile, so waiting costs nothing but time; a
    permanent error is raised at once, since retrying it would hold the job's slot forever.
    """
    retry = 0
    while True:
        try:
            return await call()
        except nats.js.errors.APIError as exc:
            if not _server_side(exc):
                raise
            error = str(exc)
        except TRANSIENT_NATS_ERRORS as exc:
            error = str(exc) or type(exc).__name__
        retry += 1
        log.warning(f"{what} failed; retrying", error=error)
        await asyncio.sleep(BACKOFF.delay(retry))


class TrajectoryStore:
    """Stores trajectories (and dead letters); publishes are pipelined (``broker.JetStreamPublisher``): many
    rollouts' trajectories wait for their acks at once, each still acked only once stored.
    Both are written in ``encoding`` (the consumer's ``--encoding``), named by their
    ``Content-Type`` header."""

    def __init__(
        self,
        js: JetStreamContext,
        topo: Topology,
        worker_id: str,
        *,
        encoding: Encoding = MSGPACK,
    ) -> None:
        self.js = js
        self.topo = topo
        self.worker_id = worker_id
        self.encoding = encoding
        self.publisher = JetStreamPublisher(js._nc)
        # fitted() encodes a trajectory to measure it; publish_trajectory() sends those bytes
        # instead of encoding again (by identity; popped at once, bounded against leaks).
        self._payloads: dict[int, tuple[Trajectory, bytes]] = {}
        self._attempts: KeyValue | None = None
        self._attempts_missing = False  # warned once: no attempts KV, every delivery counts

    async def close(self) -> None:
        await self.publisher.close()

    async def _attempts_kv(self) -> KeyValue:
        if self._attempts is None:
            self._attempts = await self.js.key_value(self.topo.attempts_bucket)
        return self._attempts

    async def failures(self, job: Job, delivery: int) -> int:
        """How many runs of the job failed so far (the attempts KV). Without the KV (a broker
        provisioned by an older release, a role that may not read it) every earlier delivery
        counts as a failed run, as before lost deliveries were told apart."""
        key = self.topo.attempts_key(job.agent, job.job_id)

        async def lookup() -> int:
            kv = await self._attempts_kv()
            try:
                entry = await kv.get(key)
            except nats.js.errors.KeyNotFoundError:  # deleted or never failed
                return 0
            return int(entry.value or 0)

        try:
            return await _until_done("failed-runs lookup", lookup)
        except (nats.errors.Error, ValueError) as exc:
            self._no_attempts_kv(exc)
            return delivery - 1

    async def count_failure(self, job: Job, failures: int) -> None:
        """Record that ``failures`` runs of the job have failed, before it is naked."""
        key = self.topo.attempts_key(job.agent, job.job_id)

        async def put() -> None:
            kv = await self._attempts_kv()
            await kv.put(key, str(failures).encode())

        try:
            await _until_done("failed-run count", put)
        except nats.errors.Error as exc:
            self._no_attempts_kv(exc)

    def _no_attempts_kv(self, exc: Exception) -> None:
        if not self._attempts_missing:
            self._attempts_missing = True
            log.warning(
                "no attempts KV: a lost delivery counts as a failed run; `agentarium broker "
                "init` creates it",
                bucket=self.topo.attempts_bucket,
                error=str(exc) or type(exc).__name__,
            )

    @property
    def max_payload(self) -> int:
        """The largest message the server takes (its INFO's max_payload)."""
        return getattr(getattr(self.js, "_nc", None), "max_payload", 0) or DEFAULT_MAX_PAYLOAD

    def fitted(self, trajectory: Trajectory) -> Trajectory:
        """The trajectory, or, when it would exceed the server's max_payload (a task near the
        limit, huge metrics, many long calls), a status ``error`` one that says so, without
        the calls and metrics (and without the task and metadata if need be). Publishing it
        as it is would fail every attempt, and the job would end without a trajectory."""
        fitted, payload = self._fit(trajectory)
        self._payloads[id(fitted)] = (fitted, payload)
        if len(self._payloads) > PAYLOAD_MEMO:  # fitted but never published (cancelled)
            self._payloads.pop(next(iter(self._payloads)))
        return fitted

    def _fit(self, trajectory: Trajectory) -> tuple[Trajectory, bytes]:
        payload = self.encoding.encode(trajectory)
        limit = self.max_payload
        if len(payload) <= limit:
            return trajectory, payload
        why = (
            f"the trajectory is {len(payload)} bytes, over the NATS server's max_payload of "
            f"{limit}: stored as an error without its {len(trajectory.calls)} calls and its "
            "metrics (keep tasks and agent results small, or raise max_payload)"
        )
        if trajectory.error:
            why += f"; its own error: {trajectory.error[:FITTED_ERROR_CHARS]}"
        smaller = replace(trajectory, status="error", reward=None, metrics={}, calls=[], error=why)
        payload = self.encoding.encode(smaller)
        if len(payload) > limit:
            smaller = replace(
                smaller, task={}, metadata={}, error=f"{why}; the task and metadata dropped too"
            )
            payload = self.encoding.encode(smaller)
        log.warning(
            "trajectory over max_payload stored as an error",
            job_id=trajectory.job_id,
            size=len(payload),
            max_payload=limit,
        )
        return smaller, payload

    async def stored(self, job: Job) -> bool:
        """Whether the job's trajectory exists (one last-message lookup on its subject)."""
        return await _until_done(
            "trajectory lookup",
            lambda: trajectory_stored(self.js, self.topo, job.run, job.agent, job.job_id),
        )

    async def publish_trajectory(self, trajectory: Trajectory) -> bool:
        """Store it; False when the server says one is already stored for this job."""
        subject = self.topo.trajectory_subject(trajectory.run, trajectory.agent, trajectory.job_id)
        memo = self._payloads.pop(id(trajectory), None)
        if memo is not None and memo[0] is trajectory:
            payload = memo[1]
        else:
            trajectory, payload = self._fit(trajectory)

        async def publish() -> bool:
            try:
                await self.publisher.publish(
                    subject,
                    payload,
                    self.encoding.headers({"Nats-Expected-Last-Subject-Sequence": "0"}),
                )
                return True
            except nats.js.errors.APIError as exc:
                if exc.err_code == ERR_WRONG_LAST_SEQUENCE:
                    return False
                raise

        return await _until_done("trajectory publish", publish)

    async def requeue(self, msg: Msg) -> None:
        """Publish a released job again as a fresh message (delivery count 1) at the back of
        its queue, keeping its headers (trace context) and counting the release; the caller
        acks ``msg`` after. Raises when the server refuses (a full queue) or does not answer.

        Its ``Nats-Msg-Id`` is the original's plus this message's stream sequence: a publish
        retried after a lost ack is dropped as a duplicate, while the producer's own id stays
        free to catch a resubmitted batch."""
        headers = {k: v for k, v in (msg.headers or {}).items() if not k.startswith("Nats-")}
        original = (msg.headers or {}).get("Nats-Msg-Id", "")
        sequence = msg.metadata.sequence.stream
        headers["Nats-Msg-Id"] = f"{original}.released.{sequence}".lstrip(".")
        headers[RELEASES_HEADER] = str(releases(msg) + 1)
        await self.publisher.publish(msg.subject, msg.data, headers)

    async def dead_letter(
        self,
        subject: str,
        data: bytes,
        *,
        reason: str,
        error: str,
        attempts: int,
        job: Job | None = None,
    ) -> DeadLetter:
        """Publish the job (or its raw bytes when it could not be decoded) with the reason,
        under the agent of the subject it arrived on: a job naming another agent
        (``wrong_subject``) is that subject's consumer's to report, not the named agent's."""
        agent = self.topo.agent_of_subject(subject)
        letter = DeadLetter(
            reason=reason,
            error=error,
            subject=subject,
            attempts=attempts,
            worker_id=self.worker_id,
            at=time.time(),
            job=job.to_wire(binary=False) if job else {},
            job_id=job.job_id if job else "",
            raw=None if job else base64.b64encode(data[:MAX_RAW_BYTES]).decode(),
        )
        if job is None and len(data) > MAX_RAW_BYTES:
            letter = replace(
                letter,
                error=f"{error} (raw payload truncated to {MAX_RAW_BYTES} of {len(data)} bytes)",
            )
        payload = self.encoding.encode(letter)
        if len(payload) > self.max_payload:  # a job near the limit plus its error
            keep = min(MAX_RAW_BYTES, self.max_payload // 4)
            letter = replace(
                letter,
                job={},
                raw=base64.b64encode(data[:keep]).decode(),
                error=f"{error[:FITTED_ERROR_CHARS]} (the dead letter would exceed max_payload: "
                f"the job is kept as raw bytes, truncated to {min(keep, len(data))} of "
                f"{len(data)})",
            )
            payload = self.encoding.encode(letter)

        async def publish() -> DeadLetter:
            await self.publisher.publish(
                self.topo.dead_subject(agent), payload, self.encoding.headers()
            )
            return letter

        return await _until_done("dead-letter publish", publish)
