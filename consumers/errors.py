"""Errors raised by the consumer side, grouped by what the caller should do.

LLMError                 calling an inference backend failed
├── BackendUnavailable   infrastructure: every server failed after retries and failover;
│                        the rollout ends with status ``error`` (never reward 0)
└── BadRequest           the backend refused the request (HTTP 4xx): retrying the same
                         request cannot help (prompt too long, bad sampling parameter)

CrossSamplingError       (a ValueError) configuration: the cross-sampling model cannot take the
                         policy's token ids (another tokenizer), or that cannot be checked;
                         raised when the consumer starts, fix the flags
"""

from __future__ import annotations


class LLMError(Exception):
    """Root of every error raised while calling an inference backend."""


class BackendUnavailable(LLMError):
    """No server answered usefully after retries and failover (connection errors, timeouts,
    5xx, unusable responses). ``errors`` maps each URL tried to its last error."""

    def __init__(self, message: str, *, errors: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.errors = dict(errors or {})


class BadRequest(LLMError):
    """The backend answered 4xx: the request itself is wrong, so it is not retried."""

    def __init__(self, message: str, *, status: int = 400, url: str = "", body: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.url = url
        self.body = body


class CrossSamplingError(ValueError):
    """The second model of cross-sampling does not share the policy's tokenizer, or its
    tokenizer cannot be compared with the policy's; the message names both models."""
