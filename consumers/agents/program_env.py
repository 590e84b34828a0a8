"""An environment session for a program agent (``--agent NAME=exec:CMD --env ENV``): the
rollout opens a session of ENV on the job's task, the program acts in it through a small HTTP
bridge, and the reward is the session's score at close (docs/design.md, "Program agents").

    GET  $AGENTARIUM_ENV_URL/observation   {"messages": [...], "tools": [...]}: what it opened with
    POST $AGENTARIUM_ENV_URL/step          an assistant message (OpenAI-style, its tool calls in
                                           "tool_calls") -> {"messages", "reward", "done", "truncated"}

The bridge listens on 127.0.0.1 (programs run on the consumer's machine), one per event loop,
started with its first session and stopped after its last. Each session's URL carries a fresh
256-bit secret, valid while the program runs; any other path gets the same 404. A step the
environment refuses answers 400 (409 once the session is done) with the reason; one that
fails answers 502; what failed is also the rollout's to judge (an environment lost is retried).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import weakref
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from aiohttp import web

from ..errors import EnvClientError, EnvRequestError
from .envclient import EnvSession

_bridges: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, EnvBridge] = (
    weakref.WeakKeyDictionary()
)


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode()).digest()


class EnvBridge:
    """The HTTP side of the program agents' sessions on one event loop."""

    def __init__(self) -> None:
        self.sessions: dict[bytes, EnvSession] = {}
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._lock = asyncio.Lock()

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_get("/e/{secret}/observation", self._observation)
        app.router.add_post("/e/{secret}/step", self._step)
        self._runner = web.AppRunner(app, access_log=None)  # paths hold secrets: no access log
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

    @asynccontextmanager
    async def route(self, session: EnvSession) -> AsyncIterator[str]:
        """The session's URL while the block runs."""
        async with self._lock:
            if self._runner is None:
                await self._start()
        secret = secrets.token_urlsafe(32)
        self.sessions[_digest(secret)] = session
        try:
            yield f"http://127.0.0.1:{self.port}/e/{secret}"
        finally:
            del self.sessions[_digest(secret)]
            async with self._lock:
                if not self.sessions and self._runner is not None:
                    runner, self._runner = self._runner, None
                    await runner.cleanup()

    def _session(self, request: web.Request) -> EnvSession:
        session = self.sessions.get(_digest(request.match_info["secret"]))
        if session is None:
            raise web.HTTPNotFound(
                text='{"error": "no session here"}', content_type="application/json"
            )
        return session

    async def _observation(self, request: web.Request) -> web.Response:
        observation = self._session(request).observation
        assert observation is not None, "a routed session has started"
        return web.json_response({"messages": observation.messages, "tools": observation.tools})

    async def _step(self, request: web.Request) -> web.Response:
        session = self._session(request)
        try:
            message = await request.json()
        except ValueError:
            return _error(400, "the step is not JSON: send the assistant message")
        if not isinstance(message, dict) or message.get("role", "assistant") != "assistant":
            return _error(400, "a step is one assistant message: {'role': 'assistant', ...}")
        if session.done:
            return _error(409, "the session is done: end the program")
        try:
            result = await session.step({"role": "assistant", **message})
        except EnvRequestError as exc:
            return _error(400, str(exc))
        except EnvClientError as exc:
            return _error(502, str(exc))
        return web.json_response(
            {
                "messages": result.messages,
                "reward": result.reward,
                "done": result.done,
                "truncated": result.truncated,
            }
        )


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


def bridge() -> EnvBridge:
    """This event loop's bridge."""
    loop = asyncio.get_running_loop()
    found = _bridges.get(loop)
    if found is None:
        found = _bridges[loop] = EnvBridge()
    return found


def outcome_reward(session: EnvSession) -> dict[str, Any]:
    """The closed session's score as the reward, and what it did as metrics."""
    outcome = session.outcome
    assert outcome is not None, "the session closed"
    metrics = {f"env_{k}": float(v) for k, v in outcome.metrics.items()}
    metrics.update(
        steps=float(session.seq), env_score=float(outcome.score), done=float(session.done)
    )
    return {"reward": float(outcome.score), "metrics": metrics}
