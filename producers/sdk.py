"""TaskProducer: publish jobs to the TASKS stream, pipelined, deduplicated, never dropped.

Each job is one JetStream publish with ``Nats-Msg-Id`` = its job id and a W3C
``traceparent`` from its own ``publish tasks`` span. Up to ``max_in_flight`` publishes wait
for their acks at once (``pipeline.py``), so a batch costs about ``jobs / max_in_flight``
round trips instead of one per job. A full stream or a restarting broker is waited out
with backoff; only a refusal that retrying cannot fix raises ``ProducerError``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import nats
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from opentelemetry import context as otel_context

from agentarium.broker import Backoff, NatsSettings, Topology
from agentarium.schemas import MSGPACK, Job, check_name

from .errors import ProducerError, StreamMissing
from .jobs import expand_tasks
from .pipeline import Entry, Pipeline
from .retry import PUBLISH_BACKOFF, PublishOutcome

log = structlog.get_logger("agentarium.producers")

# A new "stream is full" warning after this long without one: one warning per episode.
EPISODE_GAP_S = 30.0

ProgressCallback = Callable[[int, int], None]

MAX_IN_FLIGHT = 512  # publishes awaiting their ack at once, unless a caller says otherwise


@dataclass(frozen=True)
class SubmitResult:
    """What one ``submit`` did. ``published + duplicates == len(job_ids)``."""

    run: str
    batch_id: str
    job_ids: list[str]
    group_ids: list[str]
    published: int
    duplicates: int


@dataclass
class ProducerStats:
    published: int = 0
    duplicates: int = 0
    retries: int = 0
    full_waits: int = 0
    waited_s: float = 0.0


@dataclass
class _Episode:
    """One stretch of trouble (stream full, broker away): warn at its start, not on every retry."""

    message: str
    last_at: float = field(default=-1e18)

    def hit(self, **kv: Any) -> None:
        now = time.monotonic()
        if now - self.last_at > EPISODE_GAP_S:
            log.warning(self.message, **kv)
        self.last_at = now


class TaskProducer:
    """Publishes jobs to ``<prefix>.tasks.<agent>``.

    ``TaskProducer(js)`` borrows a JetStream context; ``await TaskProducer.connect()`` owns
    its connection and closes it in ``aclose()`` (or ``async with``).
    """

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology | None = None,
        *,
        max_in_flight: int = MAX_IN_FLIGHT,
        ack_timeout_s: float = 5.0,
        retry: Backoff = PUBLISH_BACKOFF,
    ) -> None:
        if max_in_flight < 1:
            raise ValueError("max_in_flight must be >= 1")
        if ack_timeout_s <= 0:
            raise ValueError("ack_timeout_s must be > 0")
        self.js = js
        self.nc: nats.NATS = js._nc  # nats-py keeps no public handle on a context's connection
        self.topology = topology or Topology()
        self.max_in_flight = max_in_flight
        self.ack_timeout_s = ack_timeout_s
        self.retry = retry
        self.stats = ProducerStats()
        self._owns_connection = False
        self._full = _Episode("TASKS stream is full: waiting for consumers to drain it")
        self._away = _Episode("broker unavailable: retrying publishes until it is back")
        self._stream_checked_at = -1e18
        self._stream_lock = asyncio.Lock()

    @classmethod
    async def connect(cls, settings: NatsSettings | None = None, **kw: Any) -> TaskProducer:
        """Connect with ``settings`` (default: AGENTARIUM_* environment) and own the connection."""
        settings = settings or NatsSettings.from_env()
        nc = await settings.connect(name="agentarium-producer")
        kw.setdefault("topology", Topology(prefix=settings.prefix))
        producer = cls(nc.jetstream(), **kw)
        producer._owns_connection = True
        return producer

    async def aclose(self) -> None:
        """Close the connection if ``connect()`` opened it (a borrowed one is left open)."""
        if self._owns_connection and not self.nc.is_closed:
            await self.nc.close()

    async def __aenter__(self) -> TaskProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"<TaskProducer prefix={self.topology.prefix!r} max_in_flight={self.max_in_flight} "
            f"published={s.published} duplicates={s.duplicates} retries={s.retries} full_waits={s.full_waits}>"
        )

    async def submit(
        self,
        agent: str,
        tasks: Sequence[Mapping[str, Any]],
        *,
        run: str = "default",
        batch_id: str | None = None,
        on_progress: ProgressCallback | None = None,
        **options: Any,
    ) -> SubmitResult:
        """Expand ``tasks`` into ``group_size`` jobs each and publish them all; ``options``:
        ``producers.JobOptions``' fields (``group_size``, ``is_train``, ``sampling``,
        ``deadline_s``, ``metadata``), as ``expand_tasks`` takes them.

        Returns once every job is stored (or was already stored: a duplicate).
        ``on_progress(done, total)`` is called after each job's ack.
        """
        batch_id, jobs = expand_tasks(agent, tasks, run=run, batch_id=batch_id, **options)
        published, duplicates = await self.publish_jobs(jobs, on_progress=on_progress)
        return SubmitResult(
            run=run,
            batch_id=batch_id,
            job_ids=[j.job_id for j in jobs],
            group_ids=list(dict.fromkeys(j.group_id for j in jobs)),
            published=published,
            duplicates=duplicates,
        )

    async def publish_jobs(
        self, jobs: Sequence[Job], *, on_progress: ProgressCallback | None = None
    ) -> tuple[int, int]:
        """Publish ``jobs``; returns ``(published, duplicates)`` once every one is stored.

        Every job is validated and encoded before the first publish, so a bad name or an
        oversized task publishes nothing. Spans are parented on the caller's context.
        """
        entries = [self._prepare(job) for job in jobs]
        if not entries:
            return 0, 0
        pipeline = Pipeline(self, entries, otel_context.get_current(), on_progress)
        published, duplicates = await pipeline.run()
        self.stats.published += published
        self.stats.duplicates += duplicates
        return published, duplicates

    def _prepare(self, job: Job) -> Entry:
        check_name(job.job_id, "job_id")
        check_name(job.run, "run")
        subject = self.topology.tasks_subject(job.agent)
        payload = MSGPACK.encode(job.stamped())  # the pipeline sends MSGPACK.headers()
        max_payload = self.nc.max_payload
        if max_payload and len(payload) > max_payload:
            raise ProducerError(
                f"job {job.job_id} (task {job.task_id!r}) is {len(payload)} bytes, over the server's "
                f"max_payload of {max_payload}: keep large inputs out of the task (store them and "
                "pass a reference), or raise max_payload in the nats-server config",
                job_id=job.job_id,
            )
        return Entry(job, subject, payload)

    # called by the pipeline

    def note_retry(
        self, outcome: PublishOutcome, subject: str, exc: BaseException, attempt: int
    ) -> float:
        """Log the episode (once), count it, and return how long to wait."""
        delay = self.retry.delay(attempt)
        self.stats.retries += 1
        self.stats.waited_s += delay
        if outcome is PublishOutcome.FULL:
            self.stats.full_waits += 1
            self._full.hit(stream=self.topology.tasks_stream, subject=subject)
        else:
            self._away.hit(error=str(exc) or type(exc).__name__, subject=subject)
        return delay

    async def check_stream(self, job: Job) -> None:
        """Nobody answered on the subject: a restarting server, or no TASKS stream at all."""
        async with self._stream_lock:
            if time.monotonic() - self._stream_checked_at < 1.0:
                return
            try:
                await self.js.stream_info(self.topology.tasks_stream)
            except nats.js.errors.NotFoundError as exc:
                raise StreamMissing(
                    f"stream {self.topology.tasks_stream} does not exist, so job {job.job_id} has "
                    "nowhere to go: run `agentarium broker init` (or broker.provision) first",
                    job_id=job.job_id,
                ) from exc
            except Exception:  # noqa: BLE001 - the server is still coming back: retry the publish
                return
            self._stream_checked_at = time.monotonic()

    @staticmethod
    def closed_error(job: Job) -> ProducerError:
        return ProducerError(
            f"the NATS connection was closed while publishing (job {job.job_id} and others were "
            "not acknowledged): submit the batch again on a new connection; it is deduplicated",
            job_id=job.job_id,
        )

    @staticmethod
    def fatal_error(job: Job, subject: str, exc: BaseException) -> ProducerError:
        detail = getattr(exc, "description", None) or str(exc) or type(exc).__name__
        code = getattr(exc, "err_code", None)
        suffix = f" (err_code {code})" if code else ""
        return ProducerError(
            f"job {job.job_id} (task {job.task_id!r}) was refused on {subject}: {detail}{suffix}",
            job_id=job.job_id,
        )
