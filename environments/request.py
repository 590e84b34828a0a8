"""One request a worker answers: its message, the endpoint it counts on, when it began.

Every answer goes through ``Request.reply`` or ``Request.error``, so each is counted once on
its endpoint (the NATS service API's figures), errors are counted in the worker's figures and
Prometheus, and an error carries the service API's headers. Answers are encoded like the
request: JSON to a JSON request, msgpack otherwise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from agentarium.schemas import ENV_ERROR_CODES, JSON, MSGPACK, Encoding, EnvError, is_json

from .metrics import EnvMetrics
from .service import Endpoint
from .stats import WorkerCounters

REPLY_HEADROOM = 1024  # room under max_payload for the reply's subject and headers
BAD_REQUEST_CODES = (400, 404, 408, 409, 413)  # counted as the client's mistakes


@dataclass(frozen=True)
class Replier:
    """What every answer of one worker goes through: its connection and its figures."""

    nc: Client
    counters: WorkerCounters
    metrics: EnvMetrics

    def request(self, msg: Msg, endpoint: Endpoint) -> Request:
        return Request(msg, endpoint, self)


@dataclass
class Request:
    msg: Msg
    endpoint: Endpoint
    replier: Replier
    began: int = field(default_factory=time.perf_counter_ns)

    @property
    def content_type(self) -> str | None:
        return (self.msg.headers or {}).get("Content-Type")

    @property
    def encoding(self) -> Encoding:
        """The request's encoding, which its reply keeps: JSON to a JSON request, msgpack
        otherwise."""
        return JSON if is_json(self.msg.data or b"", self.content_type) else MSGPACK

    def encode(self, message: Any) -> bytes:
        return self.encoding.encode(message)

    def too_large(self, reply: bytes) -> str:
        """Why a reply cannot be sent ("" when it can): nats-server refuses a message over its
        max_payload, and the client would only see its request time out. The observation cap
        is measured on msgpack; a JSON reply (control characters escaped) or an outcome's
        ``info`` (not capped) can still exceed the server's limit."""
        limit = self.replier.nc.max_payload
        if limit and len(reply) > limit - REPLY_HEADROOM:
            return (
                f"the reply is {len(reply)} bytes, over the server's max_payload of {limit} "
                "(lower the worker's --max-observation-bytes, or keep the outcome's info small)"
            )
        return ""

    async def reply(self, data: bytes) -> None:
        self.endpoint.counters.record(self.began)
        if self.msg.reply:
            await self.replier.nc.publish(self.msg.reply, data, headers=self.encoding.headers())

    async def error(self, code: int, message: str) -> None:
        name = ENV_ERROR_CODES[code]
        self.endpoint.counters.record(self.began, f"{code} {name}: {message}"[:300])
        self.replier.metrics.refused(code)
        if code in BAD_REQUEST_CODES:
            self.replier.counters.bad_requests += 1
        if not self.msg.reply:
            return
        error = EnvError(code=code, error=name, message=message)
        header = " ".join(message.split())[:512]  # header values hold no line breaks
        await self.replier.nc.publish(
            self.msg.reply,
            self.encode(error),
            headers=self.encoding.headers(
                {"Nats-Service-Error": header, "Nats-Service-Error-Code": str(code)}
            ),
        )


class ReplyTooLarge(RuntimeError):
    """A reply over the server's max_payload: the session ends with a failure (500)."""


def error_code(exc: BaseException, default: int) -> int:
    """The error code an environment's exception stands for: its ``code`` attribute when that
    is one of ``ENV_ERROR_CODES`` (the AgentBench bridge's errors carry one: 503 for a worker
    that is full or unreachable, 404 for a session it lost), else ``default``."""
    code = getattr(exc, "code", None)
    if isinstance(code, int) and not isinstance(code, bool) and code in ENV_ERROR_CODES:
        return code
    return default


def describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
