"""A fake SGLang server for tests: ``POST /generate`` with the exact shapes of SGLANG_API.md,
and the weight endpoints (``/pause_generation``, ``/update_weights_from_disk``,
``/continue_generation``, and the LoRA adapters' ``/load_lora_adapter``,
``/unload_lora_adapter``, ``/update_weight_version``), recorded in order in ``control``.
(Also ``local_engine``, which starts the real local engine when it is available.)

Instant, configurable answers (``scripted(template, policy)``: a policy that reads the prompt
as text and answers text, tool calls included); scripted failures (HTTP statuses, aborts); a gate to hold
requests in flight; per-server request counting. A request held by the gate has generated the first
half of its output when it arrived: if the weights change while it waits (an update in place), its
answer says so as SGLANG_API.md and the local engine do, ``meta_info.weight_versions``
``[{version, start, end}]``, the second half on the new version. It refuses (HTTP 400) any request field that
SGLang does not define, so a client sending extra fields fails its tests. Outages: ``stop()``
closes it (connections refused) and ``start()`` brings it back on the same port; ``hang()``
makes it accept every request, ``/health`` included, and never answer until ``unhang()``.

Streaming (``"stream": true``): SGLang's server-sent events, ``data: {...}`` chunks of
``stream_interval`` tokens each, then ``data: [DONE]``; each chunk's ``meta_info`` names the
weights at the time it is written (``weight_version``: change it while a stream is held to
see a stream span two versions) and, as SGLang's own server, no ``weight_versions``. By
default every chunk holds the whole output so far; ``incremental=True`` is SGLang's
``--incremental-streaming-output`` (each chunk only what is new; its text cut as SGLang's
detokenizer cuts it, so that a stop string begun in one chunk stays in it). ``decode`` (ids to
text, e.g. a ``ChatTemplate``'s) makes the chunks' text the decoded output so far, with a
trailing incomplete character held back as SGLang's detokenizer holds it, and applies the
request's stop strings as SGLang does (the output ends at the token that completes one,
``matched`` the string, the text cut before it); without it a chunk's text is the reply's in
proportion. ``hold_streams`` stops every stream after ``hold_after`` chunks until
``release_streams()`` or an ``/abort_request`` of its rid (which ends it with an abort, as
SGLang does); ``break_streams`` drops the next streams' connections there instead, and
``stream_errors`` answers the next streams with an in-stream error chunk. ``/abort_request``
calls are recorded in ``control``, and ``dropped`` counts streams whose client left first.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web

from agentarium.broker import free_port

# GenerateReqInput fields a client of ours may send, and SamplingParams' keys.
REQUEST_FIELDS = frozenset(
    {
        "text",
        "input_ids",
        "sampling_params",
        "rid",
        "return_logprob",
        "logprob_start_len",
        "top_logprobs_num",
        "return_text_in_logprobs",
        "stream",
        "lora_path",
    }
)
SAMPLING_FIELDS = frozenset(
    {
        "max_new_tokens",
        "stop",
        "stop_token_ids",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ignore_eos",
        "skip_special_tokens",
        "no_stop_trim",
        "logit_bias",
        "sampling_seed",
    }
)

ABORT_FIELDS = frozenset({"rid", "abort_all"})  # AbortReq's that a client sends
# UpdateWeightFromDiskReqInput fields as SGLANG_API.md lists them; pause modes.
UPDATE_WEIGHTS_FIELDS = frozenset(
    {"model_path", "load_format", "weight_version", "flush_cache", "abort_all_requests"}
)
PAUSE_MODES = ("abort", "retract", "in_place")
LORA_FIELDS = frozenset({"lora_name", "lora_path", "pinned"})  # LoadLoRAAdapterReqInput


def scripted(
    template: Any, policy: Callable[[str], str]
) -> Callable[[dict], tuple[list[int], str]]:
    """A ``reply`` for ``FakeSGLang``: the prompt's token ids decoded with the model's
    ``template`` (a ``ChatTemplate``), ``policy(prompt_text)`` the answer, encoded with the same
    tokenizer and ended with its EOS, as a model ends a turn. So a test can script a policy
    that reads what the environment showed (tool results included) and calls tools."""

    def reply(body: dict) -> tuple[list[int], str]:
        text = policy(template.decode(body.get("input_ids") or []))
        return template.encode(text) + template.eos_token_ids[:1], text

    return reply


def tool_then_answer(call_text: str, answer: str) -> Callable[[str], str]:
    """A ``scripted`` policy: ``call_text`` (a tool call) first, ``answer`` once a tool result
    is in the prompt."""
    return lambda prompt: answer if "<tool_response>" in prompt else call_text


@contextlib.asynccontextmanager
async def serving(reply: Callable[[dict], tuple[list[int], str]]):
    """A started ``FakeSGLang`` answering with ``reply``, closed on exit."""
    server = FakeSGLang(reply=reply)
    await server.start()
    try:
        yield server
    finally:
        await server.close()


def dead_url() -> str:
    """A URL where nothing listens: connections are refused."""
    return f"http://127.0.0.1:{free_port()}"


@contextlib.contextmanager
def local_engine(model_dir: Path) -> Iterator[str]:
    """The real local engine (``python -m agentarium engine``) on a free port: yields its URL.
    It is our own code and runs anywhere the tests run, so failing to start is a failure."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentarium",
            "engine",
            "--model",
            str(model_dir),
            "--port",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=Path(__file__).parents[1],
    )
    try:
        line = proc.stdout.readline()  # the engine prints one line once it listens, or exits
        if not line.startswith("engine ready on"):
            raise RuntimeError(f"the local engine did not start: {line!r} (exit {proc.poll()})")
        yield line.split(" on ", 1)[1].strip()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class FakeSGLang:
    """One fake server. ``reply(body) -> (output_ids, text)`` decides the generation; by
    default it returns ``output_ids`` and ``text`` as configured."""

    def __init__(
        self,
        *,
        output_ids: list[int] | None = None,
        text: str = "fake reply",
        reply: Callable[[dict], tuple[list[int], str]] | None = None,
        weight_version: str = "default",
        cached_tokens: int = 0,
        tokenizer_path: str = "/models/fake",
        tokenizer_fingerprint: str | None = None,
        context_len: int | None = None,
        incremental: bool = False,
        decode: Callable[[list[int]], str] | None = None,
        stream_interval: int = 1,
    ) -> None:
        self.output_ids = list(output_ids) if output_ids is not None else [11, 12, 13]
        self.text = text
        self.reply = reply
        self.weight_version = weight_version
        self.cached_tokens = cached_tokens
        # /model_info: SGLang reports tokenizer_path; only the local engine a fingerprint.
        self.tokenizer_path = tokenizer_path
        self.tokenizer_fingerprint = tokenizer_fingerprint
        # SGLang refuses (HTTP 400) a prompt whose length plus max_new_tokens is over this.
        self.context_len = context_len
        self.requests: list[dict] = []
        self.failures: list[int] = []  # HTTP statuses for the next requests, in order
        self.aborts = 0  # how many of the next requests end in an empty abort
        self.partial_aborts = 0  # ... in an abort after one token
        self.misaligned = False  # answer logprobs that do not match output_ids
        self.gate: asyncio.Event | None = None  # when set, requests wait for it to open
        self.control: list[tuple[str, dict]] = []  # (path, body) of weight/control calls
        self.update_failures = 0  # how many of the next weight updates fail
        self.paused = False
        self.adapters: dict[str, str] = {}  # LoRA adapters loaded: name -> path
        # the safetensors file of the last update, served by /get_weights_by_name (None: the
        # weights it started with, which a stand-in does not have); ignore_weights: report the
        # update's weight_version and success but keep the weights (a broken engine)
        self.weights_file: Path | None = None
        self.ignore_weights = False
        self.ignore_updates = False  # answer an update's success and change nothing at all
        self.hung: list[str] = []  # paths of the requests that arrived while hung
        # streaming (the module docstring)
        self.incremental = incremental
        self.decode = decode
        self.stream_interval = stream_interval
        self.hold_streams = False
        self.hold_after = 1
        self.break_streams = 0
        self.stream_errors = 0
        self.dropped = 0
        self.aborted: set[str] = set()  # rids named by /abort_request
        self._held: dict[str, asyncio.Event] = {}  # rid -> its stream's release
        self._answering = asyncio.Event()
        self._answering.set()
        self._arrived = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.url = ""

    @property
    def count(self) -> int:
        return len(self.requests)

    async def start(self) -> str:
        """Listen on a free port, or on the same port again after ``stop()``."""
        app = web.Application(middlewares=[self._hang_middleware])
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", lambda r: web.Response(text=""))
        app.router.add_get("/model_info", self._model_info)
        app.router.add_post("/pause_generation", self._pause)
        app.router.add_post("/continue_generation", self._continue)
        app.router.add_post("/update_weights_from_disk", self._update_weights)
        app.router.add_post("/load_lora_adapter", self._load_lora)
        app.router.add_post("/unload_lora_adapter", self._unload_lora)
        app.router.add_post("/update_weight_version", self._update_weight_version)
        app.router.add_post("/get_weights_by_name", self._get_weights_by_name)
        app.router.add_post("/abort_request", self._abort_request)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.5)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        await site.start()
        self.port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{self.port}"
        return self.url

    async def stop(self) -> None:
        """Close the server (connections refused) keeping its port and state for ``start()``."""
        if self._runner is not None:
            self._answering.set()  # hung handlers finish instead of holding the shutdown
            await self._runner.cleanup()
            self._runner = None

    def hang(self) -> None:
        """Accept every request and never answer it, until ``unhang()``."""
        self._answering.clear()

    def unhang(self) -> None:
        self._answering.set()

    @web.middleware
    async def _hang_middleware(self, request: web.Request, handler: Any) -> web.StreamResponse:
        if not self._answering.is_set():
            self.hung.append(request.path)
            await self._answering.wait()
        return await handler(request)

    async def close(self) -> None:
        if self.gate is not None:
            self.gate.set()
        await self.stop()

    def release_streams(self) -> None:
        """Let every held stream go on, and hold no more."""
        self.hold_streams = False
        for release in self._held.values():
            release.set()

    async def wait_for_held(self, n: int) -> None:
        """Return once ``n`` streams are held (``hold_streams``)."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: len(self._held) >= n)

    async def wait_for_requests(self, n: int) -> None:
        """Return once ``n`` requests have arrived (in flight or done)."""
        async with self._arrived:
            await self._arrived.wait_for(lambda: self.count >= n)

    async def _model_info(self, request: web.Request) -> web.Response:
        info = {
            "model_path": self.tokenizer_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "weight_version": self.weight_version,
        }
        if self.tokenizer_fingerprint is not None:
            info["tokenizer_fingerprint"] = self.tokenizer_fingerprint
        return web.json_response(info)

    async def _pause(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.control.append(("/pause_generation", body))
        if set(body) - {"mode"} or body.get("mode", "abort") not in PAUSE_MODES:
            return web.json_response({"error": {"message": f"bad pause {body}"}}, status=400)
        self.paused = True
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def _continue(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.control.append(("/continue_generation", body))
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def _update_weights(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.control.append(("/update_weights_from_disk", body))
        unknown = set(body) - UPDATE_WEIGHTS_FIELDS
        path = Path(str(body.get("model_path", "")))
        if unknown:
            message = f"unknown fields {sorted(unknown)}"
        elif not path.is_dir() or not any(path.glob("*.safetensors")):
            message = f"no safetensors weights in {str(path)!r}"
        elif self.update_failures:
            self.update_failures -= 1
            message = "scripted update failure"
        else:
            if body.get("weight_version") is not None and not self.ignore_updates:
                self.weight_version = str(body["weight_version"])
            if not (self.ignore_weights or self.ignore_updates):
                self.weights_file = next(iter(sorted(path.glob("*.safetensors"))))
            return web.json_response(
                {
                    "success": True,
                    "message": "Succeeded to update model weights.",
                    "num_paused_requests": 0,
                }
            )
        return web.json_response(
            {"success": False, "message": message, "num_paused_requests": 0}, status=400
        )

    async def _load_lora(self, request: web.Request) -> web.Response:
        """SGLang's LoadLoRAAdapterReqInput: lora_name, lora_path (a PEFT directory), pinned."""
        body = await request.json()
        self.control.append(("/load_lora_adapter", body))
        path = Path(str(body.get("lora_path", "")))
        if set(body) - LORA_FIELDS or not (path / "adapter_config.json").is_file():
            message = f"bad load_lora_adapter {body}"
        elif body.get("lora_name") in self.adapters:
            message = f"The LoRA adapter {body['lora_name']} is already loaded"
        else:
            self.adapters[str(body["lora_name"])] = str(path)
            return web.json_response({"success": True, "loaded_adapters": self.adapters})
        return web.json_response({"success": False, "error_message": message}, status=400)

    async def _unload_lora(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.control.append(("/unload_lora_adapter", body))
        if self.adapters.pop(str(body.get("lora_name")), None) is None:
            message = f"LoRA adapter {body.get('lora_name')} is not loaded"
            return web.json_response({"success": False, "error_message": message}, status=400)
        return web.json_response({"success": True, "loaded_adapters": self.adapters})

    async def _get_weights_by_name(self, request: web.Request) -> web.Response:
        """SGLang's GetWeightsByNameReqInput {name, truncate_size}: the parameter's first
        truncate_size rows as nested float lists; 400 "Get parameter by name failed" else."""
        body = await request.json()
        self.control.append(("/get_weights_by_name", body))
        name, size = body.get("name"), body.get("truncate_size", 100)
        if self.weights_file is not None and isinstance(name, str) and isinstance(size, int):
            from safetensors import safe_open

            with safe_open(str(self.weights_file), framework="pt") as f:
                if name in f.keys():
                    return web.json_response(f.get_slice(name)[:size].float().tolist())
        error = {"object": "error", "message": "Get parameter by name failed", "code": 400}
        return web.json_response(error, status=400)

    async def _abort_request(self, request: web.Request) -> web.Response:
        """SGLang's AbortReq: ``rid`` (or ``abort_all``); 200 and an empty body."""
        body = await request.json()
        self.control.append(("/abort_request", body))
        if set(body) - ABORT_FIELDS or not (body.get("rid") or body.get("abort_all")):
            return web.json_response(
                {"error": {"message": f"bad abort_request {body}"}}, status=400
            )
        rids = list(self._held) if body.get("abort_all") else [str(body["rid"])]
        for rid in rids:
            self.aborted.add(rid)
            if rid in self._held:
                self._held[rid].set()
        return web.Response()

    async def _update_weight_version(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.control.append(("/update_weight_version", body))
        self.weight_version = str(body["new_version"])
        return web.json_response({"success": True, "new_version": self.weight_version})

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        async with self._arrived:
            self.requests.append(body)
            self._arrived.notify_all()
        unknown = set(body) - REQUEST_FIELDS
        unknown |= {
            f"sampling_params.{k}" for k in set(body.get("sampling_params", {})) - SAMPLING_FIELDS
        }
        if unknown:
            return web.json_response(
                {"error": {"message": f"unknown fields {sorted(unknown)}"}}, status=400
            )
        started_on = self.weight_version  # the first half's weights, when held by the gate
        if self.gate is not None:
            await self.gate.wait()
        if self.failures:
            status = self.failures.pop(0)
            return web.json_response({"error": {"message": f"scripted {status}"}}, status=status)
        prompt = body.get("input_ids") or []
        asked = len(prompt) + body.get("sampling_params", {}).get("max_new_tokens", 128)
        if self.context_len is not None and asked > self.context_len:
            message = (  # SGLang's words (and the local engine's)
                "Requested token count exceeds the model's maximum context length of "
                f"{self.context_len} tokens. You requested a total of {asked} tokens."
            )
            return web.json_response({"error": {"message": message}}, status=400)
        stream = bool(body.get("stream"))
        if stream and self.stream_errors:
            self.stream_errors -= 1
            return await self._stream(request, body, [], [], "", _abort(), error="scripted error")
        if self.aborts:
            self.aborts -= 1
            if stream:
                return await self._stream(request, body, prompt, [], "", _abort())
            return web.json_response(self._response(body, prompt, [], "", _abort()))
        if self.reply is not None:
            output_ids, text = self.reply(body)
        else:
            output_ids, text = list(self.output_ids), self.text
        if self.partial_aborts:
            self.partial_aborts -= 1
            if stream:
                return await self._stream(request, body, prompt, output_ids[:1], "", _abort())
            return web.json_response(self._response(body, prompt, output_ids[:1], "", _abort()))
        max_new = body.get("sampling_params", {}).get("max_new_tokens", 1 << 30)
        stopped = self._stop_string(body, output_ids[:max_new])
        if stopped is not None:
            output_ids, text, finish = stopped
        elif len(output_ids) > max_new:
            output_ids = output_ids[:max_new]
            finish: dict[str, Any] = {"type": "length", "length": max_new}
        else:
            finish = {"type": "stop", "matched": output_ids[-1] if output_ids else None}
        if stream:
            return await self._stream(request, body, prompt, output_ids, text, finish)
        response = self._response(body, prompt, output_ids, text, finish)
        split = len(output_ids) // 2
        if started_on != self.weight_version and split > 0:  # updated in place mid-request
            response["meta_info"]["weight_versions"] = [
                {"version": started_on, "start": 0, "end": split},
                {"version": self.weight_version, "start": split, "end": len(output_ids)},
            ]
        return web.json_response(response)

    def _stop_string(self, body: dict, ids: list[int]) -> tuple[list[int], str, dict] | None:
        """With ``decode``: the output up to the token that completes one of the request's stop
        strings, its text cut before it, and the finish naming it (None: no stop string)."""
        stops = body.get("sampling_params", {}).get("stop") or []
        stops = [stops] if isinstance(stops, str) else stops
        if self.decode is None or not stops:
            return None
        for end in range(1, len(ids) + 1):
            text = self.decode(ids[:end])
            found = [(text.find(s), s) for s in stops if s in text]
            if found:
                at, stop = min(found)
                return ids[:end], text[:at], {"type": "stop", "matched": stop}
        return None

    def _text_so_far(self, output_ids: list[int], end: int, text: str) -> str:
        """A chunk's whole text after ``end`` of the output's tokens (the last chunk's is
        ``text``)."""
        if end >= len(output_ids):
            return text
        if self.decode is None:
            return text[: len(text) * end // max(1, len(output_ids))]
        return self.decode(output_ids[:end]).rstrip("\ufffd")  # SGLang's detokenizer waits

    async def _stream(
        self,
        request: web.Request,
        body: dict,
        prompt: list[int],
        output_ids: list[int],
        text: str,
        finish: dict,
        *,
        error: str = "",
    ) -> web.StreamResponse:
        """SGLang's streamed answer (the module docstring)."""
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        rid = str(body.get("rid", ""))
        breaking = self.break_streams > 0
        self.break_streams -= breaking
        step = max(1, self.stream_interval)
        ends = list(range(step, len(output_ids), step)) + [len(output_ids)]
        sent, start = 0, 0  # text and tokens written (SGLang's sent offsets)
        try:
            if error:
                await response.write(
                    b"data: " + orjson.dumps({"error": {"message": error}}) + b"\n\n"
                )
                ends = []
            for i, end in enumerate(ends):
                last = i == len(ends) - 1
                if i == self.hold_after and not last:
                    if breaking:
                        assert request.transport is not None
                        request.transport.abort()  # as a crashed server
                        return response
                    if self.hold_streams and await self._hold(rid):
                        end, last, finish = start, True, _abort()  # the tokens so far
                whole = self._text_so_far(output_ids, end, text)
                chunk = self._response(
                    body, prompt, output_ids[:end], whole, finish if last else None
                )
                meta = chunk["meta_info"]
                if not last:
                    del meta["e2e_latency"]
                if self.incremental:
                    chunk["text"], sent = whole[sent:], len(whole)
                    chunk["output_ids"] = output_ids[start:end]
                    meta["output_token_logprobs"] = meta["output_token_logprobs"][start:]
                start = end
                await response.write(b"data: " + orjson.dumps(chunk) + b"\n\n")
                if last:
                    break
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except (ConnectionError, RuntimeError):  # the client left (aiohttp's reset is one)
            self.dropped += 1
        return response

    async def _hold(self, rid: str) -> bool:
        """Wait until released; True when the wait ended by an /abort_request of ``rid``."""
        release = self._held[rid] = asyncio.Event()
        async with self._arrived:
            self._arrived.notify_all()
        try:
            if rid in self.aborted:
                return True
            await release.wait()
            return rid in self.aborted
        finally:
            del self._held[rid]

    def _response(
        self,
        body: dict,
        prompt: list[int],
        output_ids: list[int],
        text: str,
        finish: dict | None,
    ) -> dict:
        logprobs = [[-0.1 * (i + 1), tid, None] for i, tid in enumerate(output_ids)]
        if self.misaligned and logprobs:
            logprobs = logprobs[:-1]
        return {
            "text": text,
            "output_ids": output_ids,
            "meta_info": {
                "id": body.get("rid", ""),
                "finish_reason": finish,
                "prompt_tokens": len(prompt),
                "completion_tokens": len(output_ids),
                "cached_tokens": self.cached_tokens,
                "weight_version": self.weight_version,
                "output_token_logprobs": logprobs,
                "e2e_latency": 0.001,
            },
        }


def _abort() -> dict:
    return {
        "type": "abort",
        "message": "Abort all requests: weights are being updated",
        "status_code": None,
        "err_type": None,
    }
