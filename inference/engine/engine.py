"""`LocalEngine`: the model and its scheduler behind SGLang's request and response shapes,
usable in-process (`await engine.generate({...})`, `async for chunk in
engine.generate_stream({...})`) or behind the HTTP server in server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import uuid
from collections.abc import AsyncGenerator
from pathlib import Path
from typing import Any

import structlog

from agentarium.formats import load_tokenizer, tokenizer_fingerprint

from ..control import weights_checksum
from . import weight_group
from .config import EngineSettings
from .errors import InvalidRequest, WeightLoadError
from .lora import Adapter, AdapterSlot
from .model import EngineModel
from .request import parse_generate
from .scheduler import PAUSE_MODES, Scheduler
from .sequence import Sequence
from .stream import RequestStream
from .tracing import record_request

log = structlog.get_logger("agentarium.engine")

HEALTH_CHECK_TIMEOUT_S = 20.0


class LocalEngine:
    """A transformers model served with continuous batching on the CPU.

    Every method takes and returns the JSON bodies of the SGLang endpoint of the same name.
    Use as `async with LocalEngine(path) as engine:`, or call `close()`.
    """

    def __init__(
        self,
        model_path: Path | str,
        *,
        threads: int = EngineSettings.threads,
        max_batch: int = EngineSettings.max_batch,
        batch_window_s: float = 0.002,
        prefix_cache_tokens: int = EngineSettings.prefix_cache_tokens,
    ) -> None:
        self.model_path = Path(model_path)
        self.model = EngineModel(self.model_path, threads=threads)
        self.scheduler = Scheduler(
            self.model,
            max_batch=max_batch,
            batch_window_s=batch_window_s,
            prefix_cache_tokens=prefix_cache_tokens,
        )
        # Not in SGLang: tells a trainer that streams weights that this is another process
        # than the one that joined its group (restarted on the same URL), so it rebuilds it.
        self.engine_id = uuid.uuid4().hex
        self._groups: dict[str, weight_group.WeightGroup] = {}
        self._group_lock = asyncio.Lock()  # one join, leave or receive at a time
        self._spares: dict = {}  # receive buffers: the tensors the last swap replaced
        self._lora = AdapterSlot()  # the one LoRA adapter folded in (lora.py)
        log.info(
            "engine loaded",
            model_path=str(self.model_path),
            threads=threads,
            max_batch=max_batch,
            batch_window_s=batch_window_s,
            prefix_cache_tokens=prefix_cache_tokens,
            vocab_size=self.model.vocab_size,
            context_len=self.model.context_len,
        )

    def __repr__(self) -> str:
        return f"<LocalEngine {str(self.model.model_path)!r} {self.scheduler!r}>"

    async def __aenter__(self) -> LocalEngine:
        self.scheduler.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.scheduler.close()
        async with self._group_lock:
            for group in list(self._groups.values()):
                await asyncio.to_thread(weight_group.leave_group, group)
            self._groups.clear()

    @property
    def weight_version(self) -> str:
        return self.scheduler.weight_version

    # ---- /generate ------------------------------------------------------------------------

    async def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        """Run one `/generate` request; raises InvalidRequest (HTTP 400) for a bad one."""
        seq = self._sequence(body)
        if seq.request.stream:
            raise InvalidRequest(
                "stream: true answers a stream of chunks: call generate_stream(body) (over HTTP, "
                "POST /generate answers it as server-sent events)"
            )
        await self.scheduler.submit(seq)
        try:
            out = await seq.future
        except asyncio.CancelledError:
            seq.cancelled = True  # the client went away: free its row at the next step
            raise
        record_request(seq, out)  # its phases as spans under the current (server) span
        return out

    def generate_stream(self, body: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
        """Run one `/generate` request as SGLang's incremental stream: an async iterator of
        chunks, one per step that added tokens, the last with its finish_reason (stream.py).

        The body is checked here, before anything runs: a bad one raises InvalidRequest at
        once. Closing the iterator early (a client that went away) drops the request's row
        at the next step, and nothing of it is kept in the prefix cache.
        """
        return self._stream(self._sequence(body))

    async def _stream(self, seq: Sequence) -> AsyncGenerator[dict[str, Any], None]:
        stream = RequestStream(seq)
        await self.scheduler.submit(seq)
        try:
            async with contextlib.aclosing(stream.chunks()) as chunks:
                async for chunk in chunks:
                    if chunk["meta_info"]["finish_reason"] is not None:
                        record_request(seq, chunk)  # the last chunk: as a response's meta_info
                    yield chunk
        finally:
            if not seq.future.done():
                seq.cancelled = True  # closed early: free its row at the next step

    def _sequence(self, body: dict[str, Any]) -> Sequence:
        request = parse_generate(
            body,
            encode=lambda text: self.model.tokenizer.encode(text).ids,
            vocab_size=self.model.vocab_size,
            context_len=self.model.context_len,
        )
        if request.lora_path is not None and request.lora_path != self._lora.name:
            raise InvalidRequest(
                f"lora_path: LoRA adapter {request.lora_path!r} is not loaded (loaded: "
                f"{self._lora.name!r}): POST /load_lora_adapter first"
            )
        return Sequence(
            request,
            tokenizer=self.model.tokenizer,
            eos_token_ids=self.model.eos_token_ids,
            generator=self.scheduler.generator_for(request.sampling.sampling_seed),
            future=asyncio.get_running_loop().create_future(),
        )

    async def abort_request(self, body: dict[str, Any]) -> int:
        rid, abort_all = body.get("rid"), bool(body.get("abort_all", False))
        if not abort_all and not isinstance(rid, str):
            raise InvalidRequest("abort_request needs a rid (string) or abort_all: true")
        return await self.scheduler.abort(None if abort_all else rid, message="aborted by request")

    async def health_generate(self) -> bool:
        """Generate one token, as SGLang's /health_generate does."""
        if self.scheduler.paused:
            return False
        body = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        try:
            out = await asyncio.wait_for(self.generate(body), HEALTH_CHECK_TIMEOUT_S)
        except (TimeoutError, InvalidRequest):
            return False
        return out["meta_info"]["finish_reason"]["type"] != "abort"

    # ---- info -----------------------------------------------------------------------------

    def model_info(self) -> dict[str, Any]:
        config = self.model.config
        return {
            "model_path": str(self.model.model_path),
            "tokenizer_path": str(self.model_path),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
            # Not in SGLang: lets a consumer check that a cross-sampling model takes the
            # policy's token ids (consumers/backends/cross_sampling.py).
            "tokenizer_fingerprint": self.tokenizer_fingerprint,
            "engine_id": self.engine_id,
        }

    @functools.cached_property
    def tokenizer_fingerprint(self) -> str:
        """As a consumer computes it from the same directory (its chat template's loader);
        the engine's own tokenizer when the directory has no tokenizer.json."""
        if (self.model_path / "tokenizer.json").is_file():
            return tokenizer_fingerprint(load_tokenizer(self.model_path))
        return tokenizer_fingerprint(self.model.tokenizer)

    # ---- weights and control --------------------------------------------------------------

    async def update_weights_from_disk(self, body: dict[str, Any]) -> dict[str, Any]:
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise InvalidRequest("update_weights_from_disk needs model_path (a directory)")
        load_format = body.get("load_format")
        if load_format not in (None, "auto", "safetensors"):
            raise InvalidRequest(
                f"load_format {load_format!r} is not supported by the local engine: use "
                "safetensors (or leave it null)"
            )
        version = body.get("weight_version")
        success, message, paused = await self.scheduler.update_weights(
            Path(path),
            version=None if version is None else str(version),
            abort_all=bool(body.get("abort_all_requests", False)),
            # new base weights: an adapter folded into the old ones is gone with them, and a
            # head it untied follows the new embedding again (in the same pause)
            then=lambda: self._lora.forget(self.model.model),
        )
        return {"success": success, "message": message, "num_paused_requests": paused}

    # ---- LoRA adapters (lora.py) -----------------------------------------------------------

    async def load_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        """SGLang's ``/load_lora_adapter {"lora_name", "lora_path"}``: fold the adapter in
        between steps (the one loaded before comes out first)."""
        name, path = body.get("lora_name"), body.get("lora_path")
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise InvalidRequest("load_lora_adapter needs lora_name and lora_path (strings)")
        try:
            adapter = await asyncio.to_thread(Adapter.read, name, path)
        except WeightLoadError as exc:
            return _failed(str(exc))
        success, message, _ = await self.scheduler.apply_weights(
            lambda: self._lora.load(self.model.model, adapter), what=f"LoRA {name}"
        )
        return {"success": success, "message": message, "loaded_adapters": self._loaded()}

    async def unload_lora_adapter(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body.get("lora_name")
        if name != self._lora.name or name is None:
            return _failed(f"LoRA adapter {name!r} is not loaded (loaded: {self._lora.name!r})")
        success, message, _ = await self.scheduler.apply_weights(
            lambda: self._lora.unload(self.model.model), what=f"LoRA {name}"
        )
        return {"success": success, "message": message, "loaded_adapters": self._loaded()}

    def _loaded(self) -> dict[str, str]:
        adapter = self._lora.adapter
        return {} if adapter is None else {adapter.name: adapter.path}

    # ---- weights streamed over torch.distributed (weight_group.py) ------------------------

    async def init_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        """Join a trainer's weight-update group at ``rank_offset`` (this engine takes one
        rank); answers once every rank has joined."""
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank, world_size = int(body["rank_offset"]), int(body["world_size"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(
                "init_weights_update_group needs master_address, master_port, rank_offset and "
                f"world_size ({exc})"
            ) from exc
        name = str(body.get("group_name") or "weight_update_group")
        backend = str(body.get("backend") or "nccl")
        if backend != "gloo":
            return _failed(
                f"backend {backend!r} needs GPUs; the local engine runs on the CPU: use gloo"
            )
        if not 0 < rank < world_size:
            return _failed(f"rank_offset {rank} is not a receiving rank of world_size {world_size}")
        async with self._group_lock:
            if name in self._groups:
                return _failed(f"group {name!r} exists: destroy it first")
            try:
                group = await asyncio.to_thread(
                    weight_group.join_group,
                    master_address=address,
                    master_port=port,
                    rank=rank,
                    world_size=world_size,
                    group_name=name,
                    backend=backend,
                )
            except (RuntimeError, ValueError) as exc:
                log.warning("weight group join failed", group=name, error=str(exc))
                return _failed(f"Failed to initialize group {name!r}: {exc}")
            self._groups[name] = group
            if not self._spares:  # fault the receive buffers in now, not during an update
                self._spares = await asyncio.to_thread(
                    weight_group.prefault, self.model.streamable()
                )
        log.info("weight group joined", group=name, rank=rank, world_size=world_size)
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    async def destroy_weights_update_group(self, body: dict[str, Any]) -> dict[str, Any]:
        name = str(body.get("group_name") or "weight_update_group")
        async with self._group_lock:
            group = self._groups.pop(name, None)
            if group is None:
                return _failed("The group to be destroyed does not exist.")
            await asyncio.to_thread(weight_group.leave_group, group)
        log.info("weight group left", group=name, updates=group.updates)
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    async def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        """Receive one update broadcast from rank 0, then swap it in (between steps, as
        update_weights_from_disk does): all tensors, or none if any broadcast failed."""
        specs = weight_group.parse_specs(body)
        name = str(body.get("group_name") or "weight_update_group")
        load_format = body.get("load_format")
        if load_format not in (None, "auto", weight_group.FLATTENED_BUCKET):
            raise InvalidRequest(
                f"load_format {load_format!r} is not supported: null or "
                f"{weight_group.FLATTENED_BUCKET!r}"
            )
        version = body.get("weight_version")
        if body.get("abort_all_requests", False):
            await self.scheduler.abort(
                message="aborted by update_weights_from_distributed(abort_all_requests=true)"
            )
        async with self._group_lock:
            group = self._groups.get(name)
            if group is None:
                return _failed(f"group {name!r} does not exist: call /init_weights_update_group")
            try:
                received = await asyncio.to_thread(
                    weight_group.receive, group, specs, self._spares, load_format=load_format
                )
            except WeightLoadError as exc:
                log.warning("weight broadcast failed", group=name, error=str(exc))
                return _failed(str(exc))
            group.updates += 1

            replaced: dict = {}

            def swap() -> str:
                replaced.update(self.model.swap_weights(received, source=f"group {name!r}"))
                return f"Succeeded to update {len(received)} tensors from group {name!r}."

            success, message, _ = await self.scheduler.apply_weights(
                swap,
                version=None if version is None else str(version),
                what=f"group {name}",
            )
            # what was swapped out is the next update's receive buffers (a bucket arrives in
            # one new buffer and leaves the spares unused)
            if load_format != weight_group.FLATTENED_BUCKET:
                self._spares.update(replaced)
        return {"success": success, "message": message}

    async def weights_checksum(self) -> dict[str, Any]:
        """Not in SGLang: a sha256 over the served tensors (inference.weights_checksum),
        taken between steps, to compare an engine's weights with the trainer's."""
        async with self.scheduler.step_lock:
            digest, count, size = await asyncio.to_thread(
                weights_checksum, self.model.streamable().items()
            )
            version = self.scheduler.weight_version
        return {"checksum": digest, "tensors": count, "bytes": size, "weight_version": version}

    async def get_weights_by_name(self, body: dict[str, Any]) -> list:
        """SGLang's ``/get_weights_by_name {"name", "truncate_size"}``: the served parameter's
        first ``truncate_size`` entries along its first dimension, as floats (a tied output
        head answers its embedding's values), read between steps."""
        name, size = body.get("name"), body.get("truncate_size", 100)
        if not isinstance(name, str) or not name:
            raise InvalidRequest("get_weights_by_name needs name (a parameter's name)")
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise InvalidRequest("get_weights_by_name's truncate_size must be an integer >= 1")
        async with self.scheduler.step_lock:
            tensor = self.model.model.state_dict().get(name)
            if tensor is None:
                raise InvalidRequest(f"the model has no parameter {name!r}")
            return tensor[:size].detach().float().tolist()

    async def pause_generation(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        mode = (body or {}).get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise InvalidRequest(
                f"pause mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}"
            )
        await self.scheduler.pause(mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self, body: dict[str, Any] | None = None) -> dict[str, Any]:
        await self.scheduler.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def update_weight_version(self, body: dict[str, Any]) -> dict[str, Any]:
        version = body.get("new_version")
        if version is None:
            raise InvalidRequest("update_weight_version needs new_version (a string)")
        await self.scheduler.set_version(
            str(version), abort_all=bool(body.get("abort_all_requests", True))
        )
        return {
            "success": True,
            "message": f"Weight version updated to {version}",
            "new_version": str(version),
        }

    def flush_cache(self) -> bool:
        """Empty the prefix cache; like SGLang, refuse while requests run (a pause in retract
        mode leaves none running: their caches are recomputed on continue)."""
        s = self.scheduler
        if s.num_running == 0 and (s.num_waiting == 0 or s.paused):
            s.prefix_cache.flush()
            return True
        return False


def _failed(message: str) -> dict[str, Any]:
    return {"success": False, "message": message}
