"""TracingProxy: an OpenAI-compatible endpoint per rollout, so unmodified agents are traced.

An agent with the seed's contract (``rollout(task, endpoint, model)``) gets
``http://<advertised host>:<port>/r/<secret>/v1`` and points its OpenAI SDK or LangChain
``ChatOpenAI`` at it; each ``POST .../chat/completions`` runs the rollout's ``TracingLLM``, so
the call is recorded and traced exactly as a direct ``llm.chat``.

The proxy is closed: each rollout gets its own unguessable secret (``secrets.token_urlsafe``,
256 bits), valid while the rollout runs. It is what ties a call to its rollout, in the path or,
for clients that cannot change the path, as the API key on ``POST /v1/chat/completions``
(``Authorization: Bearer <secret>``). Secrets are found by their SHA-256 and then compared with
``hmac.compare_digest``; every request without a valid one gets the same 401, whether or not
some job exists. The secret is never logged, put on a span, or stored in a trajectory (the
rollout scrubs it from an agent's error text). The job id, derived from (run, batch, task,
sample), is guessable and opens nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from .errors import BackendUnavailable, BadRequest, LLMError
from .llm import TracingLLM

_OPENAI_FINISH = {"stop": "stop", "length": "length", "tool_calls": "tool_calls", "abort": "stop"}
# OpenAI request fields passed on to llm.chat as sampling options (the rest are ignored:
# logprobs, user, response_format, parallel_tool_calls, ...).
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "max_tokens",
    "max_completion_tokens",
    "stop",
    "seed",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
)
# One answer for every request without a valid secret: it must not tell a finished rollout,
# an unknown job and a wrong key apart.
_UNAUTHORIZED = (
    "no rollout in flight here accepts this request: use the endpoint URL the agent was given "
    "(http://<host>:<port>/r/<secret>/v1) as the OpenAI base_url, or send its secret as the "
    "API key; an endpoint closes when its rollout ends"
)
SECRET_BYTES = 32  # token_urlsafe(32): 43 characters, 256 bits


@dataclass(frozen=True)
class _Route:
    job_id: str
    secret: str = field(repr=False)
    llm: TracingLLM


def _digest(secret: str) -> bytes:
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).digest()


def secret_of(endpoint: str) -> str:
    """The secret in an endpoint URL this proxy handed out (``.../r/<secret>/v1``), else ""."""
    parts = endpoint.rstrip("/").split("/")
    return parts[-2] if len(parts) >= 3 and parts[-3] == "r" and parts[-1] == "v1" else ""


def default_advertised_host() -> str:
    """This machine's hostname resolved to an address other machines can reach (Ray workers
    call the proxy from elsewhere). Debian maps the hostname to 127.0.1.1 in /etc/hosts: when
    it resolves to loopback, take the address of the interface that routes outwards instead."""
    name = socket.gethostname()
    try:
        address = socket.gethostbyname(name)
    except OSError:
        return name
    if not address.startswith("127."):
        return address
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it picks a route
            outward = probe.getsockname()[0]
    except OSError:
        return address
    return outward if not outward.startswith(("127.", "0.")) else address


def _error(status: int, message: str, code: str = "invalid_request_error") -> web.Response:
    body = {"error": {"message": message, "type": code, "param": None, "code": None}}
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return web.json_response(body, status=status, headers=headers)


class TracingProxy:
    """One per consumer process; rollouts register their ``TracingLLM`` while they run."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = 0, advertised_host: str | None = None
    ) -> None:
        self.host = host
        self.port = port
        if advertised_host:
            self.advertised_host = advertised_host
        elif host not in ("0.0.0.0", "::", ""):
            self.advertised_host = host  # bound to one address: that is the one to advertise
        else:
            self.advertised_host = default_advertised_host()
        self._by_job: dict[str, _Route] = {}
        self._by_digest: dict[bytes, _Route] = {}
        # Compared against when no route matches, so a miss costs what a hit costs.
        self._decoy = secrets.token_urlsafe(SECRET_BYTES)
        self._runner: web.AppRunner | None = None
        self.requests = 0
        self.rejected = 0

    def _app(self) -> web.Application:
        # Long multi-turn conversations exceed aiohttp's 1 MB default body limit.
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/r/{secret}/v1/chat/completions", self._chat_in_path)
        app.router.add_get("/r/{secret}/v1/models", self._models_in_path)
        app.router.add_post("/v1/chat/completions", self._chat_by_key)
        app.router.add_get("/v1/models", self._models_by_key)
        return app

    async def start(self) -> None:
        self._runner = web.AppRunner(self._app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.host, self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    stop = close  # the worker's shutdown path calls stop()

    async def __aenter__(self) -> TracingProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def base_url(self) -> str:
        host = self.advertised_host
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def endpoint_for(self, job_id: str) -> str:
        """The OpenAI base_url of ``job_id``'s rollout while it is registered (its secret in
        the path); KeyError once it is not."""
        route = self._by_job[job_id]
        return f"{self.base_url}/r/{route.secret}/v1"

    @contextmanager
    def _registration(self, job_id: str) -> Iterator[str]:
        try:
            yield self.endpoint_for(job_id)
        finally:
            self.unregister(job_id)

    def register(self, job_id: str, llm: TracingLLM) -> AbstractContextManager[str]:
        """Route the calls of ``job_id``'s rollout to ``llm`` under a new secret; use it as
        ``with proxy.register(job_id, llm) as endpoint:``, which closes the endpoint on exit."""
        if job_id in self._by_job:
            if self._by_job[job_id].llm is not llm:
                raise ValueError(f"job {job_id!r} is already registered with the proxy")
            return self._registration(job_id)
        route = _Route(job_id, secrets.token_urlsafe(SECRET_BYTES), llm)
        self._by_job[job_id] = route
        self._by_digest[_digest(route.secret)] = route
        return self._registration(job_id)

    def unregister(self, job_id: str) -> None:
        route = self._by_job.pop(job_id, None)
        if route is not None:
            self._by_digest.pop(_digest(route.secret), None)

    @property
    def in_flight(self) -> list[str]:
        return list(self._by_job)

    def _find(self, presented: str) -> TracingLLM | None:
        """The rollout whose secret is ``presented``: looked up by its SHA-256 (which tells an
        attacker nothing about the secret), then compared in constant time."""
        route = self._by_digest.get(_digest(presented)) if presented else None
        expected = route.secret if route is not None else self._decoy
        same = hmac.compare_digest(
            expected.encode("utf-8", "surrogatepass"), presented.encode("utf-8", "surrogatepass")
        )
        return route.llm if route is not None and same else None

    def _lookup_path(self, request: web.Request) -> TracingLLM | None:
        return self._find(request.match_info["secret"])

    def _lookup_key(self, request: web.Request) -> TracingLLM | None:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        return self._find(key)

    async def _chat_in_path(self, request: web.Request) -> web.Response:
        return await self._chat(request, self._lookup_path(request))

    async def _chat_by_key(self, request: web.Request) -> web.Response:
        return await self._chat(request, self._lookup_key(request))

    async def _models_in_path(self, request: web.Request) -> web.Response:
        return self._models(self._lookup_path(request))

    async def _models_by_key(self, request: web.Request) -> web.Response:
        return self._models(self._lookup_key(request))

    def _models(self, llm: TracingLLM | None) -> web.Response:
        if llm is None:
            self.rejected += 1
            return _error(401, _UNAUTHORIZED, "authentication_error")
        model = {"id": llm.model_name, "object": "model", "created": 0, "owned_by": "agentarium"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request, llm: TracingLLM | None) -> web.Response:
        self.requests += 1
        if llm is None:
            self.rejected += 1
            return _error(401, _UNAUTHORIZED, "authentication_error")
        try:
            body = await request.json()
        except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply
            return _error(400, "the request body is not JSON")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list):
            return _error(400, "the request needs a 'messages' list")
        if body.get("stream"):
            return _error(
                400, "streaming is not supported by the Agentarium tracing proxy: set stream=false"
            )
        if body.get("n") not in (None, 1):
            return _error(400, "n > 1 is not supported: one rollout samples one reply per call")
        tools = body.get("tools") or None
        if body.get("tool_choice") == "none":
            tools = None
        sampling = {key: body[key] for key in _SAMPLING_FIELDS if body.get(key) is not None}
        try:
            result = await llm.chat(body["messages"], tools=tools, **sampling)
        except BadRequest as exc:
            return _error(400, str(exc))
        except (TypeError, ValueError) as exc:
            return _error(400, f"invalid request: {exc}")
        except BackendUnavailable as exc:
            return _error(503, str(exc), "server_error")
        except LLMError as exc:
            return _error(502, str(exc), "server_error")
        return web.json_response(self._completion(result, body.get("model") or llm.model_name))

    @staticmethod
    def _completion(result: Any, model: str) -> dict:
        call = result.call
        message: dict[str, Any] = {"role": "assistant", "content": result.content or None}
        if result.tool_calls:
            message["tool_calls"] = result.tool_calls
        elif message["content"] is None:
            message["content"] = ""
        prompt_tokens = len(call.prompt_ids)
        completion_tokens = len(call.response_ids)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": message,
                    "finish_reason": _OPENAI_FINISH.get(result.finish_reason, "stop"),
                    "logprobs": None,
                }
            ],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    def __repr__(self) -> str:
        return (
            f"TracingProxy({self.base_url}, in_flight={len(self._by_job)}, "
            f"requests={self.requests}, rejected={self.rejected})"
        )
