"""EngineControl: the one client of an engine's control API (SGLang's, and the local engine's,
which serves the same endpoints), with one error type.

The weight syncer (``consumers``: reload from a directory) and the weight streamer
(``trainer``: a torch.distributed group) both drive engines through it, so an endpoint's
shape, SGLang's older spellings (``/get_model_info``) and what counts as a failure are
written once. Every call either returns the engine's JSON answer or raises
``EngineControlError`` naming the engine, the path, the HTTP status (None when the engine
did not answer) and the engine's own message. SGLang answers its weight calls with
``{"success": bool, "message": str}`` (HTTP 400 on failure) and pause/continue with a plain
200; a weight call whose ``success`` is not true is a failure even with a 200.

It lives in ``broker`` because both components use it and neither may import the other;
``weights_checksum`` is here for the same reason (torch is imported only when it is called).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import aiohttp

from .errors import BrokerError

CONTROL_TIMEOUT_S = 10.0  # pause, continue, model info: answered at once by a live engine
# SGLang's spellings, newest first: older servers have only the second (404 on the first)
MODEL_INFO_PATHS = ("/model_info", "/get_model_info")
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")


class EngineControlError(BrokerError):
    """An engine refused a control call or did not answer it."""

    def __init__(self, url: str, path: str, message: str, *, status: int | None = None) -> None:
        where = f"{path} answered HTTP {status}" if status is not None else path
        super().__init__(f"{url}: {where}: {message}" if message else f"{url}: {where}")
        self.url = url
        self.path = path
        self.status = status
        self.message = message


class EngineControl:
    """The control API of one engine at ``url``, over a caller's aiohttp session."""

    def __init__(self, http: aiohttp.ClientSession, url: str) -> None:
        self.http = http
        self.url = url.rstrip("/")

    def __repr__(self) -> str:
        return f"EngineControl({self.url!r})"

    # ---- reads ---------------------------------------------------------------------------

    async def model_info(self, timeout_s: float | None = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """``GET /model_info`` (``/get_model_info`` on older SGLang): the served model,
        ``weight_version`` and, on the local engine, ``engine_id``."""
        return await self._get_first(MODEL_INFO_PATHS, timeout_s)

    async def server_info(self, timeout_s: float | None = CONTROL_TIMEOUT_S) -> dict[str, Any]:
        """``GET /server_info`` (``/get_server_info`` on older SGLang): e.g. ``tp_size``."""
        return await self._get_first(SERVER_INFO_PATHS, timeout_s)

    async def weight_version(self, timeout_s: float = CONTROL_TIMEOUT_S) -> str | None:
        """The served ``weight_version`` as the engine spells it (None: it reports none)."""
        version = (await self.model_info(timeout_s)).get("weight_version")
        return None if version is None else str(version)

    # ---- generation ----------------------------------------------------------------------

    async def pause(self, mode: str = "in_place", timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        await self.post("/pause_generation", {"mode": mode}, timeout_s)

    async def resume(self, timeout_s: float = CONTROL_TIMEOUT_S) -> None:
        await self.post("/continue_generation", {}, timeout_s)

    # ---- weights -------------------------------------------------------------------------

    async def update_weights_from_disk(
        self, *, model_path: str, weight_version: str, timeout_s: float | None
    ) -> str:
        """Reload from a model directory; the engine's message."""
        body = {
            "model_path": model_path,
            "load_format": None,
            "weight_version": weight_version,
            "flush_cache": True,
            "abort_all_requests": False,
        }
        return await self.weights_call("/update_weights_from_disk", body, timeout_s)

    async def init_weights_update_group(self, body: dict[str, Any], timeout_s: float) -> str:
        """Join a torch.distributed group (``master_address``, ``master_port``,
        ``rank_offset``, ``world_size``, ``group_name``, ``backend``)."""
        return await self.weights_call("/init_weights_update_group", body, timeout_s)

    async def update_weights_from_distributed(
        self, body: dict[str, Any], timeout_s: float | None
    ) -> str:
        """Receive the tensors ``body`` names over the group (``names``, ``dtypes``,
        ``shapes``, ``group_name``, ``weight_version``, ...)."""
        return await self.weights_call("/update_weights_from_distributed", body, timeout_s)

    async def destroy_weights_update_group(
        self, group_name: str, timeout_s: float = CONTROL_TIMEOUT_S
    ) -> str:
        return await self.weights_call(
            "/destroy_weights_update_group", {"group_name": group_name}, timeout_s
        )

    async def weights_call(self, path: str, body: dict[str, Any], timeout_s: float | None) -> str:
        """A call answered ``{success, message}``: the message, or EngineControlError."""
        answer = await self.post(path, body, timeout_s)
        if answer.get("success") is False:
            raise EngineControlError(self.url, path, str(answer.get("message", "")), status=200)
        return str(answer.get("message", ""))

    # ---- HTTP ----------------------------------------------------------------------------

    async def post(self, path: str, body: dict[str, Any], timeout_s: float | None) -> dict:
        """POST ``body``; the JSON object answered with 200 (``{}`` for an empty body).
        ``timeout_s`` None: no total bound (a large model's broadcast), only on connecting."""
        try:
            async with self.http.post(
                self.url + path, json=body, timeout=_timeout(timeout_s)
            ) as resp:
                status, text = resp.status, await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise EngineControlError(self.url, path, str(exc) or type(exc).__name__) from exc
        try:
            data = json.loads(text) if text.strip() else {}
        except ValueError:
            data = None
        if status != 200:
            said = data.get("message") if isinstance(data, dict) else None
            raise EngineControlError(self.url, path, str(said or text[:200]), status=status)
        return data if isinstance(data, dict) else {}

    async def _get_first(self, paths: tuple[str, ...], timeout_s: float | None) -> dict[str, Any]:
        """GET the first of ``paths`` the engine has (404 means: try the next spelling)."""
        for path in paths:
            try:
                async with self.http.get(self.url + path, timeout=_timeout(timeout_s)) as resp:
                    if resp.status == 404:
                        continue
                    if resp.status != 200:
                        text = await resp.text()
                        raise EngineControlError(self.url, path, text[:200], status=resp.status)
                    data = await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                raise EngineControlError(self.url, path, str(exc) or type(exc).__name__) from exc
            if not isinstance(data, dict):
                raise EngineControlError(self.url, path, "did not answer a JSON object")
            return data
        raise EngineControlError(self.url, paths[0], "not served (404)", status=404)


def _timeout(seconds: float | None) -> aiohttp.ClientTimeout:
    if seconds is None:
        return aiohttp.ClientTimeout(total=None, sock_connect=CONTROL_TIMEOUT_S)
    return aiohttp.ClientTimeout(total=seconds)


def weights_checksum(named: Iterable[tuple[str, Any]]) -> tuple[str, int, int]:
    """(sha256 hex, tensors, bytes) over torch tensors sorted by name: each adds its name,
    dtype, shape and raw bytes. The local engine's ``GET /weights_checksum`` and the trainer's
    side of a stream compute it alike, so a test can tell the engine holds what was sent."""
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
