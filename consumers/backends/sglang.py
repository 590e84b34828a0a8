"""SGLangBackend: SGLang's native ``POST /generate`` over one or more servers.

Sends only fields SGLang defines (``input_ids``, ``sampling_params``, ``return_logprob``,
``logprob_start_len``, ``rid``) and reads ``meta_info`` as SGLANG_API.md describes it. Failure
handling, from the request's point of view:

- connection errors, timeouts, 408/429/5xx and unusable 200s: retried on the same server with
  capped exponential backoff, then the server is marked down and the request fails over to
  another one; when every server has failed, ``BackendUnavailable``;
- any other 4xx (or an abort SGLang tags with status 400): ``BadRequest``, never retried;
- ``finish_reason`` abort with no output tokens (a weight update aborted the request before it
  produced anything): resubmitted up to ``abort_retries`` times;
- a server whose breaker is open (``open_breaker``: its health probe failed, consumers/fleet.py)
  is skipped, and the requests in flight on it are cut off and fail over at once.

Weight versions: ``meta_info.weight_version`` names the weights of the last token; when an
update in place changed them while the request ran, ``meta_info.weight_versions`` lists each
version's span of output tokens (``[{version, start, end}]``: the local engine, SGLANG_API.md),
kept as ``GenerateResult.weight_spans``. Without that list an unstreamed call is recorded as
one version, its last token's (SGLang's own server reports a request's version changes only on
streamed chunks' ``meta_info.weight_version``, from which a streamed call builds its spans).

Streaming (``generate(request, on_chunk=...)``): the same request with ``"stream": true``,
read as server-sent events (``SGLangStream``) and handed on chunk by chunk, the result the
unstreamed call's. Until a chunk has been handed on, failures are retried, failed over and
resubmitted as above; after, the caller has acted on those tokens and a failure raises
``BackendUnavailable`` ("the stream broke after N tokens"). A stream left early (``generate``
cancelled, ``on_chunk`` raising) drops its connection and asks the server, in the background,
to stop generating (``POST /abort_request {"rid"}``; vLLM's ``/inference/v1/abort_requests``).

Each resubmission carries a fresh ``rid`` (``<rid>-r<n>``): the server may still hold the
first attempt, and SGLang refuses a duplicate request id.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import orjson
import structlog

from agentarium.formats import HeldText
from agentarium.inference import EngineControl, EngineControlError
from agentarium.schemas import spans_problem

from ..errors import BackendUnavailable, BadRequest
from ..redact import log_safe
from .balancer import StickyBalancer
from .base import (
    BackendRetry,
    GenerateChunk,
    GenerateRequest,
    GenerateResult,
    OnChunk,
    retryable_status,
)
from .http import HttpError, HttpPool, StreamResponse
from .streaming import ChunkReader, ErrorChunk, chunk_spans, stop_strings, trim_stop

log = structlog.get_logger("agentarium.consumers")

_FINISH_TYPES = ("stop", "length", "abort")
# An abort of a stream left early: sent in the background, given up (and logged) after this.
ABORT_TIMEOUT_S = 2.0
# After ``data: [DONE]``, how long the body's end may take to come (then the connection is
# reused; past it, dropped).
_DRAIN_S = 1.0


def _plain(value: Any) -> Any:
    """What orjson cannot write itself: numpy scalars (and anything else with ``item()``)."""
    if callable(getattr(value, "item", None)):
        return value.item()
    raise TypeError(f"cannot send a {type(value).__name__} to SGLang as JSON")


def _refuse_client_abort(result: GenerateResult, url: str, body: Callable[[], str]) -> None:
    """An abort SGLang tags with a 4xx status (the request's own fault) as ``BadRequest``."""
    finish = result.meta_info.get("finish_reason")
    if isinstance(finish, dict) and 400 <= int(finish.get("status_code") or 0) < 500:
        raise BadRequest(
            f"{url} aborted the request: {finish.get('message', finish)}",
            status=int(finish["status_code"]),
            url=url,
            body=body(),
        )


class _ServerFailed(Exception):
    """One attempt on one server failed in a way worth retrying."""


def checked_logprobs(triples: list, output_ids: list, offset: int = 0) -> list[float]:
    """The log-probs of ``output_token_logprobs`` triples, checked one by one against the ids
    (``offset``: the index of the first, for the message); ValueError when they differ."""
    if len(triples) != len(output_ids):
        raise ValueError(
            f"{len(triples)} output_token_logprobs for {len(output_ids)} output_ids: not aligned"
        )
    logprobs: list[float] = []
    for i, (triple, token_id) in enumerate(zip(triples, output_ids, strict=True), offset):
        logprob, triple_id = triple[0], triple[1]
        if triple_id != token_id or not isinstance(logprob, (int, float)):
            raise ValueError(
                f"output_token_logprobs[{i}] = {triple!r} does not match output_ids[{i}] = {token_id}"
            )
        logprobs.append(float(logprob))
    return logprobs


def parse_generate_response(data: Any, *, url: str = "", latency_s: float = 0.0) -> GenerateResult:
    """A ``/generate`` response as a ``GenerateResult``; raises ValueError when the response
    cannot be trained on (missing fields, logprobs not aligned with ``output_ids``)."""
    if isinstance(data, list) and len(data) == 1:
        data = data[0]
    if not isinstance(data, dict) or not isinstance(data.get("meta_info"), dict):
        raise ValueError(f"response has no meta_info object: {str(data)[:200]}")
    meta = data["meta_info"]
    triples = meta.get("output_token_logprobs")
    if not isinstance(triples, list):
        raise ValueError("meta_info.output_token_logprobs is missing: was return_logprob sent?")
    output_ids = data.get("output_ids")
    if output_ids is None:  # older servers: the ids only travel inside the triples
        output_ids = [t[1] for t in triples]
    logprobs = checked_logprobs(triples, output_ids)
    finish = meta.get("finish_reason")
    kind = finish.get("type") if isinstance(finish, dict) else finish
    if kind not in _FINISH_TYPES:
        raise ValueError(f"unknown finish_reason {finish!r}")
    version = str(meta.get("weight_version", "default"))
    return GenerateResult(
        output_ids=[int(t) for t in output_ids],
        output_logprobs=logprobs,
        text=data.get("text") or "",
        finish_reason=kind,
        weight_version=version,
        weight_spans=weight_spans(meta.get("weight_versions"), len(output_ids), version),
        cached_tokens=int(meta.get("cached_tokens") or 0),
        prompt_tokens=int(meta.get("prompt_tokens") or 0),
        completion_tokens=int(meta.get("completion_tokens") or len(output_ids)),
        backend=url,
        latency_s=latency_s,
        meta_info=meta,
    )


def weight_spans(listed: Any, tokens: int, last_version: str) -> list[tuple[str, int]]:
    """``meta_info.weight_versions`` (``[{version, start, end}]`` over the output tokens) as
    ``LLMCall.weight_spans``: ``[(version, start), ...]``, empty when absent or one version.
    Raises ValueError for spans that do not describe this response (LLMCall's rule)."""
    if not listed:
        return []
    if not isinstance(listed, list):
        raise ValueError(f"meta_info.weight_versions is not a list: {str(listed)[:200]}")
    spans: list[tuple[str, int]] = []
    for span in listed:
        start = span.get("start") if isinstance(span, dict) else None
        if (
            not isinstance(span, dict)
            or not isinstance(span.get("version"), str)
            or isinstance(start, bool)
            or not isinstance(start, int)
        ):
            raise ValueError(f"meta_info.weight_versions holds {str(span)[:200]}")
        spans.append((span["version"], start))
    problem = spans_problem(spans, tokens, last_version)
    if problem:
        raise ValueError(f"meta_info.weight_versions: {problem}")
    return spans if len(spans) > 1 else []


class SGLangStream(ChunkReader):
    """SGLang's streamed ``/generate`` chunks put together into the response the unstreamed
    call answers (``response()``); ``feed`` returns each chunk but the last as the
    ``GenerateChunk`` to hand on.

    SGLang writes two shapes. By default each chunk repeats the whole output so far (``text``,
    ``output_ids``, ``meta_info.output_token_logprobs``); under ``--incremental-streaming-output``
    a chunk holds only what is new. ``meta_info.completion_tokens`` counts the whole output in
    both, so a chunk of that many ids is the whole and one of fewer the new ones (the first
    chunk reads the same either way). A chunk's ``meta_info.weight_version`` is its last
    token's: where the last chunk lists no ``weight_versions``, the versions' changes from
    chunk to chunk become them (exact at SGLang's default of one token a chunk; a chunk of
    several is put whole on its version).

    Incremental text is cut here where SGLang's is not: its chunks send a stop string's
    beginning as it is generated, and when the token completing it ends the request, the last
    chunk, trimmed, adds nothing and cannot take back what was sent. So a last chunk of no text
    after a matched stop string cuts the text sent before it at the stop string's beginning (a
    server that holds such text back, as the local engine does, sends it in the last chunk).
    """

    def __init__(self, *, stops: Sequence[str] = (), keep_stop: bool = False) -> None:
        self.held = HeldText(stops)
        self.keep_stop = keep_stop
        self.ids: list[int] = []
        self.triples: list[Any] = []
        self.text = ""
        self.versions: list[tuple[str, int]] = []  # (version, first token) at each change
        self.handed = 0  # tokens handed on
        self.rid = ""  # meta_info.id: the request id the server knows
        self.incremental = False  # seen to be the incremental shape
        self.last_text = ""  # the last chunk's text, incremental
        self.last: dict[str, Any] | None = None  # the last chunk's meta_info

    def feed(self, data: Any) -> GenerateChunk | None:
        data = self.chunk_object(data)
        meta = data.get("meta_info")
        if not isinstance(meta, dict):
            raise ValueError(f"a chunk has no meta_info object: {str(data)[:200]}")
        triples = meta.get("output_token_logprobs")
        if not isinstance(triples, list):
            raise ValueError("meta_info.output_token_logprobs is missing: was return_logprob sent?")
        ids = data.get("output_ids")
        if ids is None:
            ids = [t[1] for t in triples]
        have, total = len(self.ids), meta.get("completion_tokens")
        if self.incremental:
            whole = False
        elif isinstance(total, int):
            whole = len(ids) == total >= have
        else:  # a server that does not count: the whole if it repeats what came before
            whole = len(ids) >= have and ids[:have] == self.ids
        if not whole and isinstance(total, int) and total != have + len(ids):
            raise ValueError(
                f"a chunk of {len(ids)} output_ids says completion_tokens {total} after {have}: "
                "neither the whole output so far nor its new tokens"
            )
        text = data.get("text")
        if whole:
            if len(triples) != len(ids):
                raise ValueError(f"{len(triples)} output_token_logprobs for {len(ids)} output_ids")
            new_ids, new_triples = ids[have:], triples[have:]
            if text is not None:
                self.text = text
        else:
            self.incremental = True
            new_ids, new_triples = ids, triples
            self.text += text or ""
            self.last_text = text or ""
        logprobs = checked_logprobs(new_triples, new_ids, have)
        version = str(meta.get("weight_version", "default"))
        if new_ids and (not self.versions or self.versions[-1][0] != version):
            self.versions.append((version, have))
        self.ids += new_ids
        self.triples += new_triples
        self.rid = str(meta.get("id") or self.rid)
        if meta.get("finish_reason") is not None:
            self.last = meta
            return None
        piece = self.held.release(self.text)
        if not new_ids and not piece:
            return None
        self.handed += len(new_ids)
        return GenerateChunk([int(t) for t in new_ids], logprobs, piece, version)

    def response(self) -> dict[str, Any]:
        """The unstreamed call's response, put together (for ``parse_generate_response``)."""
        if self.last is None:
            raise ValueError("the stream ended before its last chunk (one with a finish_reason)")
        meta = {**self.last, "output_token_logprobs": self.triples}
        last_version = str(meta.get("weight_version", "default"))
        if not meta.get("weight_versions") and len(self.versions) > 1:
            if self.versions[-1][0] == last_version:
                meta["weight_versions"] = chunk_spans(self.versions, len(self.ids))
        text = self.text
        finish = meta.get("finish_reason")
        matched = finish.get("matched") if isinstance(finish, dict) else None
        if (
            self.incremental
            and not self.last_text
            and isinstance(matched, str)
            and matched
            and not self.keep_stop
        ):
            text = trim_stop(text, matched)
        return {"text": text, "output_ids": self.ids, "meta_info": meta}


async def _drain(response: StreamResponse) -> None:
    """Read past ``data: [DONE]`` to the body's end, so that the connection is reused; a body
    that does not end within ``_DRAIN_S`` leaves it dropped instead."""
    with contextlib.suppress(TimeoutError, HttpError):
        async with asyncio.timeout(_DRAIN_S):
            while await response.read():
                pass


class SGLangBackend:
    """Token-in/token-out generation on an SGLang fleet (or the local engine, same API)."""

    streams = True  # generate takes on_chunk (base.Backend)

    # gen_ai.provider.name on chat spans: no well-known value names SGLang, so a custom one.
    provider_name = "sglang"
    engine_name = "SGLang"  # in errors
    generate_path = "/generate"
    abort_path = "/abort_request"

    def __init__(
        self,
        urls: str | Sequence[str],
        *,
        retries: int = 3,
        backoff: float = 0.5,
        max_backoff: float = 8.0,
        timeout: float = 600.0,
        connect_timeout: float = 10.0,
        abort_retries: int = 3,
        down_for: float = 10.0,
        max_route_keys: int = 100_000,
        max_connections: int | None = None,
        lora: str | None = None,
    ) -> None:
        urls = [urls] if isinstance(urls, str) else list(urls)
        self.urls = [u.rstrip("/") for u in urls]
        self.policy = BackendRetry.of(retries=retries, backoff=backoff, max_backoff=max_backoff)
        self.abort_retries = abort_retries
        self.balancer = StickyBalancer(self.urls, max_keys=max_route_keys, down_for=down_for)
        # When each server last answered a request: a server that answers needs no probe.
        self.answered_at = dict.fromkeys(self.urls, 0.0)
        self._timeout = timeout
        self._connect_timeout = connect_timeout
        # One socket per request in flight: the fleet, not the client, sets the pace, up to
        # the process's open-file limit (HttpPool's default), beyond which requests wait.
        self._max_connections = max_connections
        self._http: HttpPool | None = None
        self._control: HttpPool | None = None
        self._aborts: set[asyncio.Task] = set()  # aborts of streams left early, on their way
        self.lora = lora  # sent as lora_path: the adapter to answer with

    @property
    def http(self) -> HttpPool:
        """The generation requests' connections (made again after ``aclose``)."""
        if self._http is None:
            self._http = HttpPool(
                timeout_s=self._timeout,
                connect_timeout_s=self._connect_timeout,
                max_connections=self._max_connections,
            )
        return self._http

    @property
    def control(self) -> HttpPool:
        """Health probes' and /model_info's own few connections: a probe never queues behind
        generation requests waiting for a connection."""
        if self._control is None:
            self._control = HttpPool(
                timeout_s=self._timeout, connect_timeout_s=self._connect_timeout, max_connections=64
            )
        return self._control

    async def aclose(self) -> None:
        if self._aborts:  # each gives up within ABORT_TIMEOUT_S
            await asyncio.gather(*self._aborts, return_exceptions=True)
        for pool in (self._http, self._control):
            if pool is not None:
                await pool.close()
        self._http = self._control = None

    async def __aenter__(self) -> SGLangBackend:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def generate(
        self, request: GenerateRequest, on_chunk: OnChunk | None = None
    ) -> GenerateResult:
        """One generation (the module docstring); with ``on_chunk``, streamed."""
        if not request.input_ids:
            raise BadRequest(
                f"{type(self).__name__} needs input_ids: give the tracing client the model's ChatTemplate"
            )
        errors: dict[str, str] = {}
        failed: set[str] = set()
        attempt = 0  # across servers and resubmissions, for unique rids
        aborts = 0
        while True:
            url = self.balancer.choose(request.route_key, exclude=failed)
            if url is None:
                for held in self.urls:
                    if self.balancer.is_held(held) and held not in errors:
                        errors[held] = "skipped: its breaker is open (health probe failed)"
                raise BackendUnavailable(
                    f"all {len(self.urls)} {self.engine_name} server(s) failed after retries: "
                    + "; ".join(f"{u}: {e}" for u, e in errors.items()),
                    errors=errors,
                )
            result = None
            for retry in range(self.policy.retries + 1):
                if self.balancer.is_held(url):
                    break  # its breaker opened meanwhile: fail over now
                if retry:
                    await asyncio.sleep(self.policy.backoff.delay(retry))
                try:
                    if on_chunk is None:
                        result = await self._post(url, request, attempt)
                    else:
                        result = await self._stream(url, request, attempt, on_chunk)
                    break
                except _ServerFailed as exc:
                    errors[url] = str(exc)
                finally:
                    attempt += 1
            if result is None:
                failed.add(url)
                self.balancer.mark_down(url)
                continue
            self.balancer.mark_up(url)
            if (
                result.finish_reason == "abort"
                and not result.output_ids
                and aborts < self.abort_retries
            ):
                await asyncio.sleep(self.policy.backoff.delay(aborts + 1))
                aborts += 1
                continue
            return result

    @staticmethod
    def _rid(request: GenerateRequest, attempt: int) -> str:
        """The request id of ``attempt``: a resubmission's is fresh (``<rid>-r<n>``), since the
        server may still hold the first and refuses a duplicate id."""
        return request.rid if attempt == 0 or not request.rid else f"{request.rid}-r{attempt}"

    def _body(self, request: GenerateRequest, attempt: int) -> dict[str, Any]:
        rid = self._rid(request, attempt)
        body: dict[str, Any] = {
            "input_ids": list(request.input_ids),
            "sampling_params": dict(request.sampling),
            "return_logprob": True,
            "logprob_start_len": -1,
        }
        if rid:
            body["rid"] = rid
        if self.lora:
            body["lora_path"] = self.lora
        return body

    def _parse(self, data: Any, url: str, latency: float) -> GenerateResult:
        return parse_generate_response(data, url=url, latency_s=latency)

    # ---- streaming: what VLLMBackend changes -----------------------------------------------
    def _stream_body(self, request: GenerateRequest, attempt: int) -> dict[str, Any]:
        return {**self._body(request, attempt), "stream": True}

    def _chunks(self, request: GenerateRequest) -> Any:
        """The reader of this engine's chunks (``feed``, ``finished``, ``handed``, ``rid``,
        ``response()``: ``SGLangStream``'s)."""
        return SGLangStream(
            stops=stop_strings(request.sampling),
            keep_stop=bool(request.sampling.get("no_stop_trim")),
        )

    def _abort_body(self, rid: str, chunks: Any) -> dict[str, Any] | None:
        """The body of ``abort_path`` that stops this attempt (None: no id to name it by)."""
        rid = rid or chunks.rid
        return {"rid": rid} if rid else None

    async def _post(self, url: str, request: GenerateRequest, attempt: int) -> GenerateResult:
        body = orjson.dumps(
            self._body(request, attempt), default=_plain, option=orjson.OPT_SERIALIZE_NUMPY
        )
        self.balancer.started(url)
        start = time.perf_counter()
        try:
            response = await self.http.request("POST", url + self.generate_path, body)
        except (HttpError, TimeoutError, OSError) as exc:
            if self.balancer.is_held(url):
                raise _ServerFailed(
                    "cut off: the server stopped answering its health probe"
                ) from exc
            raise _ServerFailed(f"{type(exc).__name__}: {exc}") from exc
        finally:
            self.balancer.finished(url)
        latency = time.perf_counter() - start
        status = response.status
        if status < 500:
            self.answered_at[url] = time.monotonic()
        if status != 200:
            raise self._refused(url, status, response.text())
        try:
            result = self._parse(response.json(), url, latency)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise _ServerFailed(f"unusable response: {exc}") from exc
        _refuse_client_abort(result, url, response.text)
        return result

    async def _stream(
        self, url: str, request: GenerateRequest, attempt: int, on_chunk: OnChunk
    ) -> GenerateResult:
        body = orjson.dumps(
            self._stream_body(request, attempt), default=_plain, option=orjson.OPT_SERIALIZE_NUMPY
        )
        chunks = self._chunks(request)
        self.balancer.started(url)
        start = time.perf_counter()
        running = True  # the server may be generating it: a stream left early is aborted
        reading = True  # an exception now is the stream's (translated), not on_chunk's
        try:
            async with self.http.stream("POST", url + self.generate_path, body) as response:
                if response.status < 500:
                    self.answered_at[url] = time.monotonic()
                if response.status != 200:
                    running = False
                    text = (await response.body()).decode("utf-8", errors="replace")
                    raise self._refused(url, response.status, text)
                async for data in response.events():
                    if data == b"[DONE]":
                        break
                    chunk = chunks.feed(orjson.loads(data))
                    if chunk is not None:
                        reading = False
                        on_chunk(chunk)
                        reading = True
                running = False  # the server ended the stream
                if chunks.finished:
                    await _drain(response)
        except ErrorChunk as exc:
            running = False
            if chunks.handed or retryable_status(exc.status):
                raise self._broken(url, chunks, str(exc)) from exc
            raise BadRequest(
                f"{url}{self.generate_path} refused the request ({exc})",
                status=exc.status,
                url=url,
                body=exc.text,
            ) from exc
        except (HttpError, TimeoutError, OSError) as exc:
            if not reading:
                raise
            running = running and not isinstance(exc, HttpError)  # its connection is gone
            if self.balancer.is_held(url):
                why = "cut off: the server stopped answering its health probe"
            else:
                why = f"{type(exc).__name__}: {exc}"
            raise self._broken(url, chunks, why) from exc
        except (ValueError, TypeError, KeyError, IndexError) as exc:  # JSONDecodeError too
            if not reading:
                raise
            raise self._broken(url, chunks, f"unusable chunk: {exc}") from exc
        finally:
            self.balancer.finished(url)
            if running:
                self._abort_soon(url, self._abort_body(self._rid(request, attempt), chunks))
        try:
            result = self._parse(chunks.response(), url, time.perf_counter() - start)
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise self._broken(url, chunks, f"unusable stream: {exc}") from exc
        _refuse_client_abort(result, url, lambda: str(result.meta_info.get("finish_reason")))
        return result

    def _refused(self, url: str, status: int, text: str) -> Exception:
        """What a non-200 answer raises: a retry (``_ServerFailed``) or ``BadRequest``."""
        if retryable_status(status):
            return _ServerFailed(f"HTTP {status}: {text[:300]}")
        return BadRequest(
            f"{url}{self.generate_path} refused the request (HTTP {status}): {text[:500]}",
            status=status,
            url=url,
            body=text,
        )

    def _broken(self, url: str, chunks: Any, why: str) -> Exception:
        """A stream's failure: retried while no chunk was handed on, else final."""
        if not chunks.handed:
            return _ServerFailed(why)
        return BackendUnavailable(
            f"{url}{self.generate_path}: the stream broke after {chunks.handed} tokens were "
            f"handed on ({why}); not retried, since the caller has acted on them",
            errors={url: f"the stream broke after {chunks.handed} tokens: {why}"},
        )

    def _abort_soon(self, url: str, body: dict[str, Any] | None) -> None:
        """Ask ``url`` to stop generating a stream left early, without waiting for it."""
        if body is None:
            log.info("a stream left early was not aborted: no request id", server=log_safe(url))
            return
        task = asyncio.get_running_loop().create_task(self._send_abort(url, body))
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    async def _send_abort(self, url: str, body: dict[str, Any]) -> None:
        error = ""
        try:
            async with asyncio.timeout(ABORT_TIMEOUT_S):
                response = await self.control.request(
                    "POST", url + self.abort_path, orjson.dumps(body)
                )
            if response.status >= 300:
                error = f"HTTP {response.status}: {response.text()[:200]}"
        except (HttpError, TimeoutError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        if error:
            log.warning(
                "could not abort a stream left early: the server may generate it to its end",
                server=log_safe(url),
                path=self.abort_path,
                request=str(body)[:200],
                error=log_safe(error),
            )

    # ---- health: what consumers/fleet.py drives ----------------------------------------------
    @property
    def servers(self) -> list[str]:
        return list(self.urls)

    async def probe(self, url: str, timeout_s: float) -> str:
        """``GET /health`` on one server: "" when it answers below 500 within ``timeout_s``,
        else what went wrong. SGLang answers it without generating (503 while unhealthy)."""
        try:
            status = (
                await self.control.request("GET", f"{url}/health", timeout_s=timeout_s)
            ).status
        except TimeoutError:
            return f"no answer to GET /health within {timeout_s:g}s"
        except (HttpError, OSError) as exc:
            return f"{type(exc).__name__}: {exc}"
        return "" if status < 500 else f"GET /health answered HTTP {status}"

    def open_breaker(self, url: str) -> int:
        """Skip ``url`` until ``close_breaker`` and cut off its requests in flight (how many)."""
        self.balancer.hold(url)
        return self.http.cut(url)

    def close_breaker(self, url: str) -> None:
        self.balancer.release(url)

    async def health(self) -> dict[str, bool]:
        """``GET /health`` on every server; a healthy answer also clears a down mark."""

        async def one(url: str) -> bool:
            ok = not await self.probe(url, 5.0)
            if ok:
                self.balancer.mark_up(url)
            return ok

        results = await asyncio.gather(*(one(u) for u in self.urls))
        return dict(zip(self.urls, results, strict=True))

    async def model_info(self) -> dict[str, Any]:
        """``GET /model_info`` (``/get_model_info`` on older servers) from the first server
        that answers; raises ``BackendUnavailable`` when none does. Asked through the
        engines' one control client (inference.EngineControl), which holds that fallback."""
        errors: dict[str, str] = {}
        async with EngineControl(timeout_s=self._timeout) as control:
            for url in self.urls:
                try:
                    return await control.model_info(url)
                except EngineControlError as exc:
                    errors[url] = str(exc)
        raise BackendUnavailable(f"no server answered /model_info: {errors}", errors=errors)

    def __repr__(self) -> str:
        return f"SGLangBackend({self.balancer!r})"
