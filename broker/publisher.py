"""JetStreamPublisher: JetStream publishes awaited concurrently over one reply subscription.

``js.publish`` in nats-py makes each publish a request (a response future behind a shared
inbox, a ``wait_for`` timer, a ``PubAck`` dataclass). Here a publish is a core NATS publish
whose reply subject is a token under one inbox of ours; JetStream answers there with the
PubAck or an error, which resolves that publish's future. Any number of publishes are in
flight at once (a consumer stores hundreds of trajectories concurrently), each awaited by its
own caller, each with its own timer. Errors are nats-py's own types, raised exactly as
``js.publish`` raises them (``APIError`` and its subclasses, ``NoStreamResponseError`` when no
stream listens, ``nats.errors.TimeoutError`` when no answer comes), so callers' retry rules
do not change.

Why not nats-py's ``publish_async``: its reply handler raises instead of failing the future
when JetStream answers with an error (a wrong last sequence, err 10071), so the future never
resolves.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats.errors
import nats.js.errors
import orjson
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

DEFAULT_TIMEOUT_S = 5.0  # what js.publish waits by default


class JetStreamPublisher:
    """``await publish(subject, payload, headers)`` returns the PubAck as a dict
    (``stream``, ``seq``, ``duplicate``) or raises what ``js.publish`` would."""

    def __init__(self, nc: Client, *, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.nc = nc
        self.timeout_s = timeout_s
        self._sub: Subscription | None = None
        self._starting: asyncio.Future[None] | None = None
        self._inbox = ""
        self._sent = 0
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}

    @property
    def in_flight(self) -> int:
        return len(self._waiting)

    async def _start(self) -> None:
        if self._starting is None:
            self._starting = asyncio.get_running_loop().create_future()
            try:
                self._inbox = self.nc.new_inbox() + "."
                self._sub = await self.nc.subscribe(self._inbox + "*", cb=self._on_reply)
            except BaseException as exc:
                self._starting.set_exception(exc)
                self._starting = None
                raise
            self._starting.set_result(None)
        elif not self._starting.done():
            await asyncio.shield(self._starting)

    async def close(self) -> None:
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(nats.errors.ConnectionClosedError())
        self._waiting.clear()
        sub, self._sub, self._starting = self._sub, None, None
        if sub is not None and not self.nc.is_closed:
            try:
                await sub.unsubscribe()
            except nats.errors.Error:
                pass  # reconnecting or closing: the subscription goes with the connection

    async def publish(
        self,
        subject: str,
        payload: bytes,
        headers: dict[str, str] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> dict[str, Any]:
        if self._sub is None:
            await self._start()
        self._sent += 1
        token = str(self._sent)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._waiting[token] = future
        timer = loop.call_later(
            self.timeout_s if timeout_s is None else timeout_s, self._expire, future
        )
        try:
            await self.nc.publish(subject, payload, reply=self._inbox + token, headers=headers)
            return await future
        finally:
            timer.cancel()
            self._waiting.pop(token, None)

    @staticmethod
    def _expire(future: asyncio.Future[dict[str, Any]]) -> None:
        if not future.done():
            future.set_exception(nats.errors.TimeoutError())

    async def _on_reply(self, msg: Msg) -> None:
        future = self._waiting.pop(msg.subject[len(self._inbox) :], None)
        if future is None or future.done():
            return  # timed out already
        status = msg.headers.get("Status") if msg.headers else None
        if status == "503":
            future.set_exception(nats.js.errors.NoStreamResponseError())
            return
        try:
            reply = orjson.loads(msg.data) if msg.data else {}
        except orjson.JSONDecodeError:
            reply = {"error": {"code": 500, "description": f"unreadable ack: {msg.data[:80]!r}"}}
        if not isinstance(reply, dict):
            reply = {"error": {"code": 500, "description": f"unexpected ack: {reply!r:.80}"}}
        if status and "error" not in reply:
            description = (msg.headers or {}).get("Description")
            reply = {"error": {"code": int(status), "description": description}}
        error = reply.get("error")
        if error is None:
            future.set_result(reply)
            return
        try:
            nats.js.errors.APIError.from_error(error)  # raises the typed error
        except nats.js.errors.APIError as exc:
            future.set_exception(exc)
        except TypeError:  # fields nats-py does not know
            future.set_exception(
                nats.js.errors.APIError(
                    code=error.get("code"),
                    err_code=error.get("err_code"),
                    description=error.get("description"),
                )
            )

    def __repr__(self) -> str:
        return f"<JetStreamPublisher in_flight={len(self._waiting)} sent={self._sent}>"
