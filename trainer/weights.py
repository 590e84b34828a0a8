"""Weight publishing and fetching: one safetensors file per policy version.

Publish (trainer side, `WeightStore.publish`): the model is saved with
``save_pretrained(dir, safe_serialization=True)`` as one safetensors file (a directory holding
one, a ``.safetensors`` file or a state dict are accepted too), hashed (sha256, lowercase hex of
the whole file), and then

- object-store mode (default): streamed in chunks into the ``agentarium-weights`` object store
  as ``<run>/v<version>``;
- shared-path mode (``weights_dir``): written under ``<weights_dir>/<run>/v<version>/`` (staged
  beside it and renamed into place, so a reader never sees half a file); the absolute path of
  the file travels in ``WeightUpdate.object`` and nothing is copied through NATS.

Only then is the WeightUpdate written (JSON) to the policy KV key ``<run>``, so a watcher never
sees a version whose bytes are not stored yet, and versions older than the newest
``keep_versions`` are pruned.

Only the safetensors file travels: config, generation config and tokenizer stay behind.
Engines reload weights in place into the architecture they already serve (the local engine
copies tensors into its live module; SGLang's ``/update_weights_from_disk`` keeps its model
config and reads the ``*.safetensors`` under ``model_path``), so the syncer hands them a
directory that holds ``model.safetensors`` alone. A model whose save would be sharded is saved
as one file (``max_shard_size`` raised); a directory with several shards is refused.

Fetching (the syncer's side) and the policy KV's reads are inference/weights.py's
``WeightFetcher``, which ``WeightStore`` extends.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions

from agentarium.broker import Topology, put_entry
from agentarium.inference import (
    STALL_TIMEOUT_S,
    WEIGHTS_FILE,
    WeightFetcher,
    WeightsError,
    local_versions,
    object_name,
    sha256_file,
)
from agentarium.schemas import JSON, WeightUpdate, check_name

log = structlog.get_logger("agentarium.weights")

MAX_CHUNK_SIZE = 1024 * 1024  # capped by the server's max_payload (1 MiB by default)


class WeightStore(WeightFetcher):
    """Publishes policy versions for the trainer (and, as a WeightFetcher, reads them).

    ``weights_dir`` switches publishing to shared-path mode. ``keep_versions`` (>= 1) versions
    per run are kept; older ones are pruned after each publish.
    """

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology | None = None,
        *,
        weights_dir: Path | str | None = None,
        keep_versions: int = 3,
        chunk_size: int | None = None,
        stall_timeout_s: float = STALL_TIMEOUT_S,
    ) -> None:
        if keep_versions < 1:
            raise ValueError("keep_versions must be >= 1: the newest version is always kept")
        super().__init__(js, topology, stall_timeout_s=stall_timeout_s)
        self.weights_dir = Path(weights_dir).expanduser().resolve() if weights_dir else None
        self.keep_versions = keep_versions
        max_payload = getattr(getattr(js, "_nc", None), "max_payload", 0) or MAX_CHUNK_SIZE
        self.chunk_size = min(chunk_size or MAX_CHUNK_SIZE, max_payload)
        self.published = 0
        self.pruned = 0

    def __repr__(self) -> str:
        mode = f"shared {self.weights_dir}" if self.weights_dir else self.topology.weights_bucket
        return (
            f"<WeightStore {mode} keep={self.keep_versions} published={self.published} "
            f"fetched={self.fetched} pruned={self.pruned}>"
        )

    # ---- publish ---------------------------------------------------------------------------

    async def publish(
        self, model_or_dir: Any, *, run: str, version: int, step: int = 0
    ) -> WeightUpdate:
        """Store the weights, then point the policy KV key ``<run>`` at them; returns the update.

        ``model_or_dir``: a transformers model (anything with ``save_pretrained``), a state dict
        of tensors, a directory holding one ``*.safetensors`` file, or such a file.
        """
        check_name(run, "run")
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        started = time.perf_counter()
        try:
            previous = await self.latest(run)
        except Exception:  # an unreadable current value is overwritten below anyway
            previous = None
        if previous is not None and previous.version >= version:
            log.warning(
                "publishing a version not newer than the current one: engines already at "
                "the current version will skip it",
                run=run,
                version=version,
                current=previous.version,
            )
        if self.weights_dir is not None:
            target, sha, size = await self._publish_shared(model_or_dir, run, version)
        else:
            target, sha, size = await self._publish_object(model_or_dir, run, version)
        update = WeightUpdate(
            run=run,
            version=version,
            step=step,
            object=target,
            sha256=sha,
            size=size,
            format="safetensors",
            created_at=time.time(),
        )
        await self.js.key_value(self.topology.policy_bucket)  # BucketNotFoundError if missing
        await put_entry(
            self.js, self.topology.policy_bucket, run, JSON.encode(update), JSON.headers()
        )
        self.published += 1
        log.info(
            "weights published",
            run=run,
            version=version,
            step=step,
            object=target,
            size=size,
            seconds=round(time.perf_counter() - started, 3),
        )
        await self.prune(run)
        return update

    async def _publish_object(self, model_or_dir: Any, run: str, version: int):
        name = object_name(run, version)
        with tempfile.TemporaryDirectory(prefix="agentarium-weights-") as tmp:
            file, _ = await asyncio.to_thread(materialize, model_or_dir, Path(tmp))
            obs = await self.js.object_store(self.topology.weights_bucket)
            meta = ObjectMeta(
                name=name,
                description=f"policy weights, run {run} version {version} (safetensors)",
                options=ObjectMetaOptions(max_chunk_size=self.chunk_size),
            )
            with open(file, "rb") as raw:
                reader = _HashingReader(raw)
                # nats-py reads any object with readinto(); its annotation lists only
                # str | bytes | BufferedIOBase.
                info = await obs.put(name, reader, meta=meta)  # type: ignore[arg-type]
        if info.size != reader.size:
            raise WeightsError(f"object {name}: stored {info.size} bytes, read {reader.size}")
        return name, reader.hexdigest(), reader.size

    async def _publish_shared(self, model_or_dir: Any, run: str, version: int):
        assert self.weights_dir is not None
        run_dir = self.weights_dir / run
        run_dir.mkdir(parents=True, exist_ok=True)
        final = run_dir / f"v{version}"
        stage = run_dir / f".v{version}.{uuid.uuid4().hex[:8]}.stage"
        try:
            stage.mkdir()
            file, owned = await asyncio.to_thread(materialize, model_or_dir, stage / "save")
            out = stage / "out"
            out.mkdir()
            if owned:
                os.replace(file, out / WEIGHTS_FILE)
            else:  # never move the caller's own file
                await asyncio.to_thread(shutil.copyfile, file, out / WEIGHTS_FILE)
            sha, size = await asyncio.to_thread(sha256_file, out / WEIGHTS_FILE)
            if final.exists():  # the same version published again (a resumed trainer)
                shutil.rmtree(final)
            os.replace(out, final)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        return str(final / WEIGHTS_FILE), sha, size

    def for_run(self, run: str) -> RunPublisher:
        """This store bound to one run: the trainer loop's publisher."""
        return RunPublisher(self, run)

    # ---- prune -----------------------------------------------------------------------------

    async def versions(self, run: str) -> list[int]:
        """Versions of ``run`` stored now (object store, or the shared directory), ascending."""
        if self.weights_dir is not None:
            return local_versions(self.weights_dir / check_name(run, "run"))
        prefix = f"{check_name(run, 'run')}/v"
        obs = await self.js.object_store(self.topology.weights_bucket)
        try:
            infos = await obs.list(ignore_deletes=True)
        except nats.js.errors.NotFoundError:
            return []
        found = []
        for info in infos:
            if info.deleted or not info.name.startswith(prefix):
                continue
            tail = info.name[len(prefix) :]
            if tail.isdigit():
                found.append(int(tail))
        return sorted(found)

    async def prune(self, run: str, keep: int | None = None) -> list[int]:
        """Delete all but the newest ``keep`` (default ``keep_versions``) versions; returns them."""
        keep = self.keep_versions if keep is None else keep
        if keep < 1:
            raise ValueError("keep must be >= 1")
        old = (await self.versions(run))[:-keep]
        if not old:
            return []
        if self.weights_dir is not None:
            for version in old:
                shutil.rmtree(self.weights_dir / run / f"v{version}", ignore_errors=True)
        else:
            obs = await self.js.object_store(self.topology.weights_bucket)
            for version in old:
                try:
                    await obs.delete(object_name(run, version))
                except nats.js.errors.NotFoundError:
                    pass  # another publisher pruned it first
        self.pruned += len(old)
        log.info("weights pruned", run=run, versions=old, kept=keep)
        return old

    # ---- fetch -----------------------------------------------------------------------------


class RunPublisher:
    """A WeightStore bound to one run, with the trainer loop's ``WeightPublisher`` shape:
    ``publish(model, version, step)`` and ``latest_version()`` (so a resumed trainer numbers
    its next version above anything its killed predecessor published)."""

    def __init__(self, store: WeightStore, run: str) -> None:
        self.store = store
        self.run = check_name(run, "run")

    def __repr__(self) -> str:
        return f"<RunPublisher run={self.run} {self.store!r}>"

    async def publish(self, model: Any, version: int, step: int) -> WeightUpdate:
        return await self.store.publish(model, run=self.run, version=version, step=step)

    async def latest_version(self) -> int | None:
        update = await self.store.latest(self.run)
        return None if update is None else update.version


class _HashingReader:
    """A binary reader that hashes what nats-py's ObjectStore.put reads through ``readinto``."""

    def __init__(self, raw) -> None:
        self._raw = raw
        self._digest = hashlib.sha256()
        self.size = 0

    def readinto(self, buffer) -> int:
        n = self._raw.readinto(buffer)
        if n:
            self._digest.update(memoryview(buffer)[:n])
            self.size += n
        return n or 0

    def hexdigest(self) -> str:
        return self._digest.hexdigest()


def materialize(model_or_dir: Any, scratch: Path) -> tuple[Path, bool]:
    """One safetensors file holding the weights, and whether it is ours (saved into
    ``scratch``) rather than the caller's own file."""
    if isinstance(model_or_dir, str | os.PathLike):
        path = Path(model_or_dir)
        if path.is_file() and path.suffix == ".safetensors":
            return path, False
        if path.is_dir():
            return _single_safetensors(path), False
        raise WeightsError(
            f"{str(path)!r} is neither a .safetensors file nor a directory holding one"
        )
    scratch.mkdir(parents=True, exist_ok=True)
    if hasattr(model_or_dir, "save_pretrained"):
        _save_pretrained(model_or_dir, scratch)
        return _single_safetensors(scratch), True
    if isinstance(model_or_dir, Mapping):
        from safetensors.torch import save_file

        state = {k: v.detach().contiguous().cpu() for k, v in model_or_dir.items()}
        save_file(state, str(scratch / WEIGHTS_FILE), metadata={"format": "pt"})
        return scratch / WEIGHTS_FILE, True
    raise TypeError(
        f"cannot publish a {type(model_or_dir).__name__}: pass a transformers model, a state "
        "dict of tensors, or a directory/file with safetensors weights"
    )


def _save_pretrained(model: Any, out: Path) -> None:
    kwargs: dict[str, Any] = {"max_shard_size": "10000GB"}  # one file: one object per version
    # transformers 5 always writes safetensors and dropped the flag; 4.x needs it.
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kwargs["safe_serialization"] = True
    try:  # a service's stderr carries log lines, not tqdm bars
        from transformers.utils import logging as hf_logging
    except ImportError:
        model.save_pretrained(str(out), **kwargs)
        return
    bars_were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(str(out), **kwargs)
    finally:
        if bars_were_on:
            hf_logging.enable_progress_bar()


def _single_safetensors(directory: Path) -> Path:
    files = sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        raise WeightsError(
            f"{str(directory)!r} holds {len(files)} .safetensors files; publish needs exactly "
            "one: save with save_pretrained(..., max_shard_size='10000GB') or pass the model"
        )
    return files[0]
