"""TracingProxy: the gateway, one endpoint per rollout, so unmodified agents are traced.

An agent with the seed's contract (``rollout(task, endpoint, model)``), or a program given the
endpoint in ``OPENAI_BASE_URL``/``ANTHROPIC_BASE_URL``, gets
``http://<advertised host>:<port>/r/<secret>/v1`` and points its client at it. Every API the
gateway speaks (``consumers/tracing/gateway/``: OpenAI Chat Completions and Responses, streamed or not,
and Anthropic Messages) runs the rollout's ``TracingLLM``, so each call is recorded and traced
exactly as a direct ``llm.chat``.

The proxy is closed: each rollout gets its own unguessable secret (``secrets.token_urlsafe``,
256 bits), valid while the rollout runs. It is what ties a call to its rollout, in the path or,
for clients that cannot change the path, as the API key (``Authorization: Bearer <secret>`` or
Anthropic's ``x-api-key: <secret>``) on the plain ``/v1/...`` routes. Secrets are found by their
SHA-256 and then compared with ``hmac.compare_digest``; every request without a valid one gets
the same 401, whether or not some job exists. The secret is never logged, put on a span, or
stored in a trajectory (the rollout scrubs it from an agent's error text). The job id, derived
from (run, batch, task, sample), is guessable and opens nothing.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

from aiohttp import web

from .gateway import anthropic, chat, models, responses
from .gateway.errors import GatewayError, anthropic_error, openai_error
from .gateway.route import Route
from .llm import TracingLLM

Handler = Callable[[web.Request, dict, Route], Awaitable[web.StreamResponse]]
ErrorShape = Callable[[GatewayError], web.Response]
# Each API's route under /v1, its handler and its error shape.
APIS: dict[str, tuple[Handler, ErrorShape]] = {
    "/chat/completions": (chat.serve, openai_error),
    "/responses": (responses.serve, openai_error),
    "/messages": (anthropic.serve, anthropic_error),
    "/messages/count_tokens": (anthropic.count_tokens, anthropic_error),
}
# One answer for every request without a valid secret: it must not tell a finished rollout,
# an unknown job and a wrong key apart.
_UNAUTHORIZED = GatewayError(
    "no rollout in flight here accepts this request: use the endpoint URL the agent was given "
    "(http://<host>:<port>/r/<secret>/v1) as the OpenAI base_url, or without its /v1 as the "
    "Anthropic base URL, or send its secret as the API key; an endpoint closes when its "
    "rollout ends",
    kind="authentication",
)
SECRET_BYTES = 32  # token_urlsafe(32): 43 characters, 256 bits


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
        self._by_job: dict[str, Route] = {}
        self._by_digest: dict[bytes, Route] = {}
        # Compared against when no route matches, so a miss costs what a hit costs.
        self._decoy = secrets.token_urlsafe(SECRET_BYTES)
        self._runner: web.AppRunner | None = None
        self.requests = 0
        self.rejected = 0

    def _app(self) -> web.Application:
        # Long multi-turn conversations exceed aiohttp's 1 MB default body limit.
        app = web.Application(client_max_size=64 * 1024 * 1024)
        for path, (handler, shape) in APIS.items():
            app.router.add_post(f"/r/{{secret}}/v1{path}", self._api(handler, shape, by_key=False))
            app.router.add_post(f"/v1{path}", self._api(handler, shape, by_key=True))
        # A model id may hold "/" (Hugging Face names): {model:.+} takes the rest of the path.
        for path, answer in (("/models", models.listing), ("/models/{model:.+}", models.one)):
            app.router.add_get(f"/r/{{secret}}/v1{path}", self._get(answer, by_key=False))
            app.router.add_get(f"/v1{path}", self._get(answer, by_key=True))
        return app

    async def start(self) -> None:
        # handler_cancellation: a client that goes away cancels its call, which aborts the
        # engine's request (aiohttp leaves handlers running by default)
        self._runner = web.AppRunner(self._app(), access_log=None, handler_cancellation=True)
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
        route = Route(job_id, secrets.token_urlsafe(SECRET_BYTES), llm)
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

    def _find(self, presented: str) -> Route | None:
        """The rollout whose secret is ``presented``: looked up by its SHA-256 (which tells an
        attacker nothing about the secret), then compared in constant time."""
        route = self._by_digest.get(_digest(presented)) if presented else None
        expected = route.secret if route is not None else self._decoy
        same = hmac.compare_digest(
            expected.encode("utf-8", "surrogatepass"), presented.encode("utf-8", "surrogatepass")
        )
        return route if route is not None and same else None

    def _lookup(self, request: web.Request, by_key: bool) -> Route | None:
        if not by_key:
            return self._find(request.match_info["secret"])
        # Anthropic's clients send x-api-key (or, with an auth token, a bearer token like
        # OpenAI's); one key is compared per request.
        key = request.headers.get("x-api-key", "").strip()
        if not key:
            auth = request.headers.get("Authorization", "")
            key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        return self._find(key)

    def _api(self, handler: Handler, shape: ErrorShape, *, by_key: bool) -> Callable:
        async def serve(request: web.Request) -> web.StreamResponse:
            self.requests += 1
            route = self._lookup(request, by_key)
            if route is None:
                self.rejected += 1
                return shape(_UNAUTHORIZED)
            try:
                body = await request.json()
            except (ValueError, RecursionError):  # RecursionError: JSON nested too deeply
                return shape(GatewayError("the request body is not JSON"))
            if not isinstance(body, dict):
                return shape(GatewayError("the request body must be a JSON object"))
            try:
                return await handler(request, body, route)
            except GatewayError as error:
                return shape(error)

        return serve

    def _get(
        self, answer: Callable[[web.Request, Route], web.Response], *, by_key: bool
    ) -> Callable:
        async def serve(request: web.Request) -> web.Response:
            route = self._lookup(request, by_key)
            if route is None:
                self.rejected += 1
                shape = anthropic_error if models.is_anthropic(request) else openai_error
                return shape(_UNAUTHORIZED)
            return answer(request, route)

        return serve

    def __repr__(self) -> str:
        return (
            f"TracingProxy({self.base_url}, in_flight={len(self._by_job)}, "
            f"requests={self.requests}, rejected={self.rejected})"
        )
