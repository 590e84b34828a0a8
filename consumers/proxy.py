"""TracingProxy: an OpenAI-compatible endpoint per rollout, so unmodified agents are traced.

An agent with the seed's contract (``rollout(task, endpoint, model)``) gets
``http://<advertised host>:<port>/rollouts/<job_id>/v1`` and points its OpenAI SDK or LangChain
``ChatOpenAI`` at it; each ``POST .../chat/completions`` runs the rollout's ``TracingLLM``, so
the call is recorded and traced exactly as a direct ``llm.chat``. The job id in the path is
what ties a call to its rollout. ``POST /v1/chat/completions`` is a fallback for clients that
cannot change the path: the API key must then be the job id (never the task id, which the G
samples of a group share).
"""

from __future__ import annotations

import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
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
_PER_ROLLOUT_HINT = (
    "use the per-rollout endpoint URL the agent was given "
    "(http://<host>:<port>/rollouts/<job_id>/v1) as the OpenAI base_url"
)


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
    return web.json_response(body, status=status)


class TracingProxy:
    """One per consumer process; rollouts register their ``TracingLLM`` while they run."""

    def __init__(
        self, host: str = "0.0.0.0", port: int = 0, advertised_host: str | None = None
    ) -> None:
        self.host = host
        self.port = port
        if advertised_host:
            self.advertised_host = advertised_host
        elif host not in ("0.0.0.0", "::", ""):
            self.advertised_host = host  # bound to one address: that is the one to advertise
        else:
            self.advertised_host = default_advertised_host()
        self._llms: dict[str, TracingLLM] = {}
        self._runner: web.AppRunner | None = None
        self.requests = 0
        self.rejected = 0

    def _app(self) -> web.Application:
        # Long multi-turn conversations exceed aiohttp's 1 MB default body limit.
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_post("/rollouts/{job_id}/v1/chat/completions", self._chat_in_path)
        app.router.add_get("/rollouts/{job_id}/v1/models", self._models_in_path)
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
        """The OpenAI base_url to hand to the agent of ``job_id``."""
        return f"{self.base_url}/rollouts/{job_id}/v1"

    @contextmanager
    def _registration(self, job_id: str) -> Iterator[str]:
        try:
            yield self.endpoint_for(job_id)
        finally:
            self.unregister(job_id)

    def register(self, job_id: str, llm: TracingLLM) -> AbstractContextManager[str]:
        """Route ``job_id``'s calls to ``llm``; usable as ``with proxy.register(...) as endpoint``,
        which unregisters on exit."""
        if job_id in self._llms and self._llms[job_id] is not llm:
            raise ValueError(f"job {job_id!r} is already registered with the proxy")
        self._llms[job_id] = llm
        return self._registration(job_id)

    def unregister(self, job_id: str) -> None:
        self._llms.pop(job_id, None)

    @property
    def in_flight(self) -> list[str]:
        return list(self._llms)

    def _lookup_path(self, request: web.Request) -> tuple[TracingLLM | None, str]:
        job_id = request.match_info["job_id"]
        llm = self._llms.get(job_id)
        if llm is None:
            return None, (
                f"no rollout {job_id!r} is in flight on this consumer: it finished, or the URL "
                f"is not one this proxy handed out; {_PER_ROLLOUT_HINT}"
            )
        return llm, ""

    def _lookup_key(self, request: web.Request) -> tuple[TracingLLM | None, str]:
        auth = request.headers.get("Authorization", "")
        key = auth[7:].strip() if auth[:7].lower() == "bearer " else ""
        if not key:
            return None, (
                f"this path has no job id and no API key was sent: {_PER_ROLLOUT_HINT}, "
                "or send the job id as the API key"
            )
        llm = self._llms.get(key)
        if llm is None:
            return None, (
                "the API key is not the id of a rollout in flight on this consumer (it must be "
                f"the job id, not the task id); {_PER_ROLLOUT_HINT}"
            )
        return llm, ""

    async def _chat_in_path(self, request: web.Request) -> web.Response:
        return await self._chat(request, *self._lookup_path(request))

    async def _chat_by_key(self, request: web.Request) -> web.Response:
        return await self._chat(request, *self._lookup_key(request))

    async def _models_in_path(self, request: web.Request) -> web.Response:
        return self._models(*self._lookup_path(request))

    async def _models_by_key(self, request: web.Request) -> web.Response:
        return self._models(*self._lookup_key(request))

    def _models(self, llm: TracingLLM | None, why: str) -> web.Response:
        if llm is None:
            self.rejected += 1
            return _error(400, why)
        model = {"id": llm.model_name, "object": "model", "created": 0, "owned_by": "agentarium"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request, llm: TracingLLM | None, why: str) -> web.Response:
        self.requests += 1
        if llm is None:
            self.rejected += 1
            return _error(400, why)
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
            f"TracingProxy({self.base_url}, in_flight={len(self._llms)}, "
            f"requests={self.requests}, rejected={self.rejected})"
        )
