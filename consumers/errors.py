"""Errors raised by the consumer side, grouped by what the caller should do.

LLMError                 calling an inference backend failed
├── BackendUnavailable   infrastructure: every server failed after retries and failover;
│                        the rollout ends with status ``error`` (never reward 0)
└── BadRequest           the backend refused the request (HTTP 4xx): retrying the same
                         request cannot help (prompt too long, bad sampling parameter)

CrossSamplingError       (a ValueError) configuration: the cross-sampling model cannot take the
                         policy's token ids (another tokenizer), or that cannot be checked;
                         raised when the consumer starts, fix the flags
TokenizerMismatch        (a ValueError) configuration: an LLM server reads another vocabulary
                         than the consumer's --model renders prompts in; raised when the
                         consumer starts, fix --model

EnvClientError           a session with an environment service failed (consumers/agents/envclient.py)
├── EnvironmentUnavailable  infrastructure: no worker with room before the deadline, or the
│                           session's worker is gone (no responders, 404, repeated timeouts);
│                           the rollout is retried, on its last attempt stored as ``error``
├── EnvironmentFailed       the environment raised (500); the worker closed the session.
│                           An agent error: retried, then dead-lettered
├── EnvironmentTimeout      (also a TimeoutError) the session's deadline passed (408)
└── EnvRequestError         the request was refused as wrong: a bad task (400), a step out of
                            order (409), a message over the worker's limit (413)
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


class TokenizerMismatch(ValueError):
    """An LLM server's tokenizer is not the one the consumer renders prompts with (their
    fingerprints differ); the message names both models."""


class EnvClientError(Exception):
    """Root of every error of an environment session; ``code`` is the worker's (0 if none)."""

    def __init__(self, message: str, *, env: str = "", session: str = "", code: int = 0) -> None:
        super().__init__(message)
        self.env = env
        self.session = session
        self.code = code


class EnvironmentUnavailable(EnvClientError):
    """No worker took the session before its deadline, or the worker holding it is gone. An
    infrastructure failure: the rollout ends with status ``error`` (retried), never reward 0."""


class EnvironmentFailed(EnvClientError):
    """The environment raised while starting, stepping or closing the session (500)."""


class EnvironmentTimeout(EnvClientError, TimeoutError):
    """The session's deadline passed (408): the worker closed it."""


class EnvRequestError(EnvClientError):
    """The worker refused the request as wrong: a bad task, a seq out of order, too large."""
