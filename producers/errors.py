"""Producer errors, grouped by what the caller should do.

    ProducerError          the job cannot be published as it is: fix it (or the broker), retrying will not help
    └── StreamMissing      the TASKS stream does not exist: run `agentarium broker init`

Backpressure (a full TASKS stream) and a broker restart are not errors: the SDK waits and
retries those itself, forever, so no job is ever dropped.
"""

from __future__ import annotations


class ProducerError(Exception):
    """Root of every error raised by ``producers``; ``job_id`` names the job when there is one."""

    def __init__(self, message: str, *, job_id: str | None = None) -> None:
        super().__init__(message)
        self.job_id = job_id


class StreamMissing(ProducerError):
    """The TASKS stream is not provisioned on this broker."""
