"""EngineControl: the one client of an engine's control API, SGLang's and the local engine's.

The local engine serves SGLang's routes with SGLang's shapes (docs: SGLANG_API.md), so the
weight syncer (``inference.sync``, reloads from disk) and the weight streamer (trainer, over a
torch.distributed group) drive both through this client. It lives in inference, beside the
engine and the syncer, and imports no service, so both sides may import it.

Every call raises ``EngineControlError`` (the URL, the path, the HTTP status or None when the
engine was not reached, and the server's own message): an HTTP error, a connection error, a
timeout, and a weight call SGLang answers ``{"success": false, "message": ...}`` alike. A
caller that must go on (un-pause an engine whatever happened) catches that one type.

Each request carries the current span's W3C ``traceparent``, so the engine's span of a weight
update joins the caller's trace.

``weights_checksum`` is the sha256 both sides compute over tensors: the trainer over what it
sends, the local engine (``GET /weights_checksum``, not in SGLang) over what it serves.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from typing import Any

import aiohttp

from agentarium.broker import BrokerError, propagating_trace_config

PAUSE_MODES = ("in_place", "retract", "abort")  # SGLang's /pause_generation modes
CONTROL_TIMEOUT_S = 30.0  # a control call that moves no weights: info, pause, continue
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")  # older SGLang serves only the second
# SGLang's pause modes as vLLM's /pause?mode= names them
VLLM_PAUSE_MODES = {"in_place": "keep", "retract": "wait", "abort": "abort"}
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")


class EngineControlError(BrokerError):
    """An engine's control call failed: not reached (``status`` None), an HTTP error, or a
    refusal (``{"success": false}``); ``message`` is the server's own words where it gave any.
    ``str()`` is ``"<path>: <message>"``: the URL is the caller's key already."""

    def __init__(self, url: str, path: str, message: str, *, status: int | None = None) -> None:
        self.url = url
        self.path = path
        self.status = status
        self.message = message
        super().__init__(f"{path}: {message}")


class EngineControl:
    """Control calls to engines by URL over one aiohttp session (made on first use).

    ``timeout_s`` bounds a control call; weight calls take their own (``None``: no total
    limit, only the connect is bounded). Use as ``async with EngineControl() as control:``,
    or call ``close()``.
    """

    def __init__(self, *, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        self.timeout_s = timeout_s
        self._http: aiohttp.ClientSession | None = None
        self._kinds: dict[str, str] = {}  # url -> "sglang" or "vllm", as first seen

    def __repr__(self) -> str:
        return f"<EngineControl timeout_s={self.timeout_s}>"

    async def __aenter__(self) -> EngineControl:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # ---- info ----------------------------------------------------------------------------------

    async def model_info(self, url: str) -> dict[str, Any]:
        """``GET /model_info``, or ``/get_model_info`` where the first is not served; for a
        server with neither (vLLM), what its ``GET /v1/models`` says of the one model it
        serves: ``model_path`` and ``tokenizer_path`` its ``root`` (the directory it loaded),
        ``served_model_name`` its ``id``, and ``weight_version`` from ``GET /weight_info``
        (vLLM's development mode)."""
        for path in MODEL_INFO_PATHS:
            try:
                info = await self.get(url, path)
            except EngineControlError as exc:
                if exc.status != 404:
                    raise
            else:
                self._kinds.setdefault(url, "sglang")
                return info
        try:
            models = (await self.get(url, "/v1/models")).get("data")
        except EngineControlError as exc:
            if exc.status != 404:
                raise
            models = None
        if isinstance(models, list) and models and isinstance(models[0], dict):
            root = models[0].get("root") or models[0].get("id")
            info = {
                "model_path": root,
                "tokenizer_path": root,
                "served_model_name": models[0].get("id"),
            }
            if models[0].get("owned_by") == "vllm":
                self._kinds[url] = "vllm"
                try:
                    info["weight_version"] = (await self.get(url, "/weight_info")).get(
                        "weight_version"
                    )
                except EngineControlError as exc:
                    if exc.status != 404:
                        raise
            return info
        raise EngineControlError(
            url, MODEL_INFO_PATHS[0], "not served (nor the older path, nor /v1/models)"
        )

    async def kind(self, url: str) -> str:
        """What serves ``url``: "vllm" (its ``/v1/models`` says it owns the model, and it
        serves no ``/model_info``) or "sglang" (SGLang, the local engine), asked once."""
        if url not in self._kinds:
            try:
                await self.model_info(url)
            except EngineControlError as exc:
                if exc.status is None:
                    raise  # not reached: ask again next time
            self._kinds.setdefault(url, "sglang")
        return self._kinds[url]

    async def weight_version(self, url: str) -> str | None:
        """The ``weight_version`` the engine serves (None: it reports none)."""
        version = (await self.model_info(url)).get("weight_version")
        return None if version is None else str(version)

    async def ranks(self, url: str) -> int:
        """Ranks the engine takes in a weight-update group: SGLang's ``tp_size``, else 1
        (the local engine serves no ``/server_info``). Never raises."""
        for path in SERVER_INFO_PATHS:
            try:
                tp = (await self.get(url, path)).get("tp_size")
            except EngineControlError:
                continue
            if isinstance(tp, int) and tp > 0:
                return tp
        return 1

    async def weights_checksum(self, url: str) -> dict[str, Any]:
        """The local engine's ``GET /weights_checksum``: ``checksum``, ``tensors``, ``bytes``,
        ``weight_version`` (not in SGLang)."""
        return await self.get(url, "/weights_checksum")

    # ---- generation ----------------------------------------------------------------------------

    async def pause(self, url: str, mode: str = "in_place") -> None:
        """``POST /pause_generation``: hold requests (``mode``) until ``resume``; vLLM's
        ``POST /pause?mode=`` (``in_place`` is its ``keep``, ``retract`` its ``wait``)."""
        if await self.kind(url) == "vllm":
            vllm_mode = VLLM_PAUSE_MODES.get(mode, mode)
            await self.post(url, f"/pause?mode={vllm_mode}", {}, self.timeout_s)
            return
        await self.post(url, "/pause_generation", {"mode": mode}, self.timeout_s)

    async def resume(self, url: str) -> None:
        """``POST /continue_generation`` (vLLM's ``/resume``)."""
        path = "/resume" if await self.kind(url) == "vllm" else "/continue_generation"
        await self.post(url, path, {}, self.timeout_s)

    # ---- weights -------------------------------------------------------------------------------

    async def update_weights_from_disk(
        self, url: str, *, model_path: str, weight_version: str, timeout_s: float | None
    ) -> str:
        """Reload from ``model_path`` (the engine's own disk); the server's message. Without a
        pause first, it waits for the requests in flight. vLLM: ``POST /collective_rpc``
        running its workers' ``reload_weights`` on the directory, then ``weight_version``
        set with ``/update_weight_version``."""
        if await self.kind(url) == "vllm":
            rpc = {"method": "reload_weights", "kwargs": {"weights_path": model_path}}
            await self.post(url, "/collective_rpc", rpc, timeout_s)
            await self.update_weight_version(url, weight_version)
            return f"reloaded {model_path} (vLLM reload_weights)"
        body = {
            "model_path": model_path,
            "load_format": None,
            "weight_version": weight_version,
            "flush_cache": True,
            "abort_all_requests": False,
        }
        return _message(await self.post(url, "/update_weights_from_disk", body, timeout_s))

    async def init_weights_update_group(
        self,
        url: str,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str,
        timeout_s: float | None,
    ) -> str:
        """Join the group rank 0 serves at ``master_address:master_port`` (answers once every
        rank joined, so rank 0 must be joining meanwhile)."""
        body = {
            "master_address": master_address,
            "master_port": master_port,
            "rank_offset": rank_offset,
            "world_size": world_size,
            "group_name": group_name,
            "backend": backend,
        }
        return _message(await self.post(url, "/init_weights_update_group", body, timeout_s))

    async def update_weights_from_distributed(
        self,
        url: str,
        *,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        group_name: str,
        weight_version: str,
        load_format: str | None = None,
        timeout_s: float | None = None,
    ) -> str:
        """Receive these tensors from rank 0's broadcast and swap them in (answers once the
        broadcast ended)."""
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": True,
            "abort_all_requests": False,
            "weight_version": weight_version,
            "load_format": load_format,
        }
        return _message(await self.post(url, "/update_weights_from_distributed", body, timeout_s))

    async def destroy_weights_update_group(self, url: str, group_name: str) -> str:
        body = {"group_name": group_name}
        return _message(await self.post(url, "/destroy_weights_update_group", body, self.timeout_s))

    async def get_weights_by_name(self, url: str, name: str, truncate_size: int) -> list:
        """SGLang's ``POST /get_weights_by_name {"name", "truncate_size"}`` (the local engine
        serves it too): the served parameter's first ``truncate_size`` entries along its first
        dimension, as nested lists of floats, read back to check what an engine serves."""
        body = {"name": name, "truncate_size": truncate_size}
        data = await self._request(
            "POST", url, "/get_weights_by_name", body, self.timeout_s, raw=True
        )
        if not isinstance(data, list):
            raise EngineControlError(
                url,
                "/get_weights_by_name",
                f"answered {type(data).__name__}, not a list",
                status=200,
            )
        return data

    # ---- LoRA adapters (SGLang's endpoints; the local engine serves them too) ---------------------

    async def load_lora_adapter(
        self, url: str, *, name: str, path: str, timeout_s: float | None
    ) -> str:
        """``POST /load_lora_adapter`` (vLLM's ``/v1/load_lora_adapter``): the PEFT adapter
        directory ``path`` (on the engine's disk) served as ``name``; the server's message."""
        body = {"lora_name": name, "lora_path": path}
        prefix = "/v1" if await self.kind(url) == "vllm" else ""
        return _message(await self.post(url, f"{prefix}/load_lora_adapter", body, timeout_s))

    async def unload_lora_adapter(self, url: str, *, name: str) -> str:
        body = {"lora_name": name}
        prefix = "/v1" if await self.kind(url) == "vllm" else ""
        return _message(await self.post(url, f"{prefix}/unload_lora_adapter", body, self.timeout_s))

    async def update_weight_version(self, url: str, version: str) -> str:
        """``POST /update_weight_version``: what generations report as ``weight_version``
        from now on (requests in flight are not aborted)."""
        body: dict[str, Any] = {"new_version": version}
        if await self.kind(url) != "vllm":
            body["abort_all_requests"] = False
        return _message(await self.post(url, "/update_weight_version", body, self.timeout_s))

    async def weight_checksums(self, url: str) -> dict[str, str]:
        """vLLM's ``POST /weight_checker {"action": "checksum"}``: parameter name (its
        ``dp0:pp0:...:`` prefix removed) -> SHA-256 of the served tensor's bytes."""
        data = await self.post(url, "/weight_checker", {"action": "checksum"}, self.timeout_s)
        sums = data.get("checksums")
        if not isinstance(sums, dict):
            raise EngineControlError(url, "/weight_checker", "answered no checksums", status=200)
        return {str(k).rsplit(":", 1)[-1]: str(v) for k, v in sums.items()}

    async def prompt_logprobs(self, url: str, ids: list[int]) -> list[float]:
        """vLLM's log-probs of each of ``ids`` after the ones before it (the first has none), at
        temperature 1: ``/inference/v1/generate`` with ``prompt_logprobs: 0``, one token made."""
        path = "/inference/v1/generate"
        body = {
            "token_ids": list(ids),
            "sampling_params": {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0},
        }
        data = await self.post(url, path, body, self.timeout_s)
        rows = data.get("prompt_logprobs")
        if not isinstance(rows, list) or len(rows) != len(ids):
            raise EngineControlError(url, path, "answered no prompt_logprobs", status=200)
        out: list[float] = []
        for token, row in zip(ids[1:], rows[1:], strict=True):
            entry = row.get(str(token)) if isinstance(row, dict) else None
            value = entry.get("logprob") if isinstance(entry, dict) else None
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise EngineControlError(url, path, f"no log-prob for token {token}", status=200)
            out.append(float(value))
        return out

    # ---- the one request path ------------------------------------------------------------------

    async def get(self, url: str, path: str, timeout_s: float | None = None) -> dict[str, Any]:
        return await self._request("GET", url, path, None, timeout_s or self.timeout_s)

    async def post(
        self, url: str, path: str, body: dict[str, Any], timeout_s: float | None
    ) -> dict[str, Any]:
        """POST ``body``; the answer's JSON object ({} for an empty or non-JSON 200)."""
        return await self._request("POST", url, path, body, timeout_s)

    async def _request(
        self,
        method: str,
        url: str,
        path: str,
        body: Any,
        timeout_s: float | None,
        *,
        raw: bool = False,
    ) -> Any:
        try:
            async with self._session().request(
                method, url.rstrip("/") + path, json=body, timeout=self._timeout(timeout_s)
            ) as resp:
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineControlError(url, path, str(exc) or type(exc).__name__) from exc
        try:
            data = json.loads(text) if text.strip() else {}
        except ValueError:
            data = None
        if resp.status != 200:
            said = _said(data)
            raise EngineControlError(
                url, path, said or f"HTTP {resp.status}: {text[:200]}", status=resp.status
            )
        if raw:
            return data
        if not isinstance(data, dict):
            if method == "GET":  # an info call's answer is its content
                raise EngineControlError(url, path, "did not answer a JSON object", status=200)
            return {}
        if data.get("success") is False:
            raise EngineControlError(url, path, _said(data) or "refused", status=200)
        return data

    def _timeout(self, seconds: float | None) -> aiohttp.ClientTimeout:
        if seconds is None:
            return aiohttp.ClientTimeout(total=None, sock_connect=self.timeout_s)
        return aiohttp.ClientTimeout(total=seconds)

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(trace_configs=[propagating_trace_config()])
        return self._http


def _said(data: Any) -> str:
    """The server's message: SGLang's weight calls answer ``{"success", "message"}``, its LoRA
    calls ``{"success", "error_message"}``, its request errors ``{"error": {"message"}}``."""
    if not isinstance(data, dict):
        return ""
    error = data.get("error")
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    return str(data.get("message") or data.get("error_message") or "")


def _message(data: dict[str, Any]) -> str:
    return str(data.get("message", ""))


def weights_checksum(named: Iterable[tuple[str, Any]]) -> tuple[str, int, int]:
    """(sha256 hex, tensors, bytes) over torch tensors sorted by name: each adds its name,
    dtype, shape and raw bytes. The trainer computes it over what it sends, the local engine
    over what it serves (``GET /weights_checksum``). torch loads on the first call only."""
    import torch

    digest = hashlib.sha256()
    count = size = 0
    for name, tensor in sorted(named, key=lambda item: item[0]):
        t = tensor.detach().contiguous().cpu()
        digest.update(f"{name}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        if t.numel():
            digest.update(t.view(-1).view(torch.uint8).numpy().data)
        count += 1
        size += t.numel() * t.element_size()
    return digest.hexdigest(), count, size
