"""OpenAICompatBackend: text in, text out through ``/v1/chat/completions`` (vLLM, hosted APIs).

For evaluation only. These servers apply their own chat template and return text, not token
ids or per-token logprobs, so the calls it records have empty ``response_ids`` and
``response_logprobs`` and can never be trained on: use ``SGLangBackend`` (or the local
engine) for training runs.

Every request carries the current span's W3C ``traceparent`` (the rollout's ``chat`` span
during a call), so a vLLM server started with ``--otlp-traces-endpoint`` puts its own spans in
the caller's trace.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from typing import Any

import aiohttp

from agentarium.broker import propagating_trace_config

from ..errors import BackendUnavailable, BadRequest
from .base import BackendRetry, FinishReason, GenerateRequest, GenerateResult, retryable_status
from .cutoff import Cutoffs

# SGLang sampling_params key → OpenAI chat.completions parameter.
_SAMPLING_TO_OPENAI = {
    "temperature": "temperature",
    "top_p": "top_p",
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "sampling_seed": "seed",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
}
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "tool_calls": "stop",
    "function_call": "stop",
    "length": "length",
}


class OpenAICompatBackend:
    """An OpenAI-compatible chat endpoint; ``base_url`` ends in ``/v1``."""

    # gen_ai.provider.name: the conventions use "openai" for the OpenAI API whoever serves it
    # (vLLM, hosted APIs); server.address and gen_ai.response.model tell them apart.
    provider_name = "openai"

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        *,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        timeout: float = 600.0,
        extra_body: dict[str, Any] | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "")
        self.policy = BackendRetry.of(retries=retries, backoff=backoff, max_backoff=max_backoff)
        self.extra_body = dict(extra_body or {})
        self._timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None
        self.cutoffs = Cutoffs([self.base_url])
        self.answered_at = {self.base_url: 0.0}
        self._held = False  # the breaker is open: fail at once instead of calling

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, headers=headers, trace_configs=[propagating_trace_config()]
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "messages": request.messages}
        for key, name in _SAMPLING_TO_OPENAI.items():
            value = request.sampling.get(key)
            if value is not None and value != []:
                body[name] = value
        top_k = request.sampling.get("top_k")
        if top_k is not None and top_k > 0:
            body["top_k"] = top_k  # a vLLM extension; hosted APIs reject it, so only when set
        if request.tools:
            body["tools"] = request.tools
        body.update(self.extra_body)
        return body

    async def generate(self, request: GenerateRequest) -> GenerateResult:
        if not request.messages:
            raise BadRequest("OpenAICompatBackend needs the chat messages, not token ids")
        url = f"{self.base_url}/chat/completions"
        body = self._body(request)
        last, tries = "", 0
        for attempt in range(self.policy.retries + 1):
            if self._held:
                last = last or "skipped: its breaker is open (health probe failed)"
                break
            if attempt:
                await asyncio.sleep(self.policy.backoff.delay(attempt))
            start = time.perf_counter()
            tries += 1
            try:
                async with (
                    self.cutoffs.guard(self.base_url),
                    self.session.post(url, json=body) as resp,
                ):
                    text = await resp.text()
                    status = resp.status
            except (aiohttp.ClientError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
                if self._held:
                    last = "cut off: the server stopped answering its health probe"
                continue
            if status < 500:
                self.answered_at[self.base_url] = time.monotonic()
            if status == 200:
                try:
                    return self._parse(json.loads(text), time.perf_counter() - start)
                except (ValueError, KeyError, IndexError, TypeError) as exc:
                    last = f"unusable response: {exc}: {text[:200]}"
                    continue
            if not retryable_status(status):
                raise BadRequest(
                    f"{url} refused the request (HTTP {status}): {text[:500]}",
                    status=status,
                    url=url,
                    body=text,
                )
            last = f"HTTP {status}: {text[:300]}"
        raise BackendUnavailable(
            f"{url} failed {tries} time(s): {last}", errors={self.base_url: last}
        )

    # ---- health: what consumers/fleet.py drives ----------------------------------------------
    @property
    def servers(self) -> list[str]:
        return [self.base_url]

    async def probe(self, url: str, timeout_s: float) -> str:
        """``GET <base>/models``: "" when the server answers below 500 within ``timeout_s``
        (a 401 is an answer: the key is wrong, not the server down), else what went wrong."""
        try:
            timeout = aiohttp.ClientTimeout(total=timeout_s)
            async with self.session.get(f"{url}/models", timeout=timeout) as resp:
                status = resp.status
        except TimeoutError:
            return f"no answer to GET /models within {timeout_s:g}s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "" if status < 500 else f"GET /models answered HTTP {status}"

    def open_breaker(self, url: str) -> int:
        self._held = True
        return self.cutoffs.cut(self.base_url)

    def close_breaker(self, url: str) -> None:
        self._held = False

    def _parse(self, data: dict, latency_s: float) -> GenerateResult:
        choice = data["choices"][0]
        message = choice.get("message") or {}
        usage = data.get("usage") or {}
        details = usage.get("prompt_tokens_details") or {}
        return GenerateResult(
            output_ids=[],
            output_logprobs=[],
            text=message.get("content") or "",
            finish_reason=_FINISH.get(choice.get("finish_reason") or "stop", "abort"),
            weight_version="default",
            cached_tokens=int(details.get("cached_tokens") or 0),
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            backend=self.base_url,
            latency_s=latency_s,
            tool_calls=message.get("tool_calls") or None,
            meta_info={"id": data.get("id"), "model": data.get("model")},
        )

    def __repr__(self) -> str:
        return f"OpenAICompatBackend({self.base_url!r}, model={self.model!r})"
