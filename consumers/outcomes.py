"""Storing a rollout's outcome: its trajectory exactly once, or the job as a dead letter.

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

import nats.js.errors
import structlog
from nats.js import JetStreamContext

from broker import ERR_WRONG_LAST_SEQUENCE, TRANSIENT_NATS_ERRORS, JetStreamPublisher, Topology
from schemas import DeadLetter, Job, Trajectory, encode

log = structlog.get_logger("agentarium.consumers")

T = TypeVar("T")

FIRST_BACKOFF_S = 0.1
MAX_BACKOFF_S = 5.0
# A dead letter keeps at most this much of an undecodable payload (base64 grows it by 4/3 and
# the server's max_payload is 1 MiB by default).
MAX_RAW_BYTES = 64 * 1024


def _server_side(exc: nats.js.errors.APIError) -> bool:
    """Whether JetStream refused for its own trouble (5xx, 503), which passes, rather than for
    the request's (4xx), which a retry would only repeat."""
    return not (exc.code and exc.code < 500 and exc.code != 503)


async def _until_done(what: str, call: Callable[[], Awaitable[T]]) -> T:
    """``await call()`` until it returns, waiting out transient failures with capped backoff.

    The job stays in flight (heartbeated) meanwhile, so waiting costs nothing but time; a
    permanent error is raised at once, since retrying it would hold the job's slot forever.
    """
    delay = FIRST_BACKOFF_S
    while True:
        try:
            return await call()
        except nats.js.errors.APIError as exc:
            if not _server_side(exc):
                raise
            error = str(exc)
        except TRANSIENT_NATS_ERRORS as exc:
            error = str(exc) or type(exc).__name__
        log.warning(f"{what} failed; retrying", error=error)
        await asyncio.sleep(delay)
        delay = min(MAX_BACKOFF_S, delay * 2)


class OutcomeStore:
    """Stores outcomes; publishes are pipelined (``broker.JetStreamPublisher``): many
    rollouts' trajectories wait for their acks at once, each still acked only once stored."""

    def __init__(self, js: JetStreamContext, topo: Topology, worker_id: str) -> None:
        self.js = js
        self.topo = topo
        self.worker_id = worker_id
        self.publisher = JetStreamPublisher(js._nc)

    async def close(self) -> None:
        await self.publisher.close()

    async def stored(self, job: Job) -> bool:
        """Whether the job's trajectory exists (one last-message lookup on its subject)."""
        subject = self.topo.trajectory_subject(job.run, job.agent, job.job_id)

        async def lookup() -> bool:
            try:
                await self.js.get_last_msg(self.topo.trajectories_stream, subject)
                return True
            except nats.js.errors.NotFoundError:
                return False

        return await _until_done("trajectory lookup", lookup)

    async def publish_trajectory(self, trajectory: Trajectory) -> bool:
        """Store it; False when the server says one is already stored for this job."""
        subject = self.topo.trajectory_subject(trajectory.run, trajectory.agent, trajectory.job_id)
        payload = encode(trajectory)

        async def publish() -> bool:
            try:
                await self.publisher.publish(
                    subject, payload, {"Nats-Expected-Last-Subject-Sequence": "0"}
                )
                return True
            except nats.js.errors.APIError as exc:
                if exc.err_code == ERR_WRONG_LAST_SEQUENCE:
                    return False
                raise

        return await _until_done("trajectory publish", publish)

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
        """Publish the job (or its raw bytes when it could not be decoded) with the reason."""
        agent = job.agent if job else self.topo.agent_of_subject(subject)
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

        async def publish() -> DeadLetter:
            await self.publisher.publish(self.topo.dead_subject(agent), encode(letter))
            return letter

        return await _until_done("dead-letter publish", publish)
