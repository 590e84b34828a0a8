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

Fetch (syncer side, `WeightStore.fetch`) streams the chunks into ``<dest>/.model.*.part``,
hashing as it writes, checks size and sha256 against the WeightUpdate, and only then renames
the file to ``<dest>/model.safetensors``; a mismatch deletes the file and raises
WeightVerificationError. nats-py's ``ObjectStore.get()`` is not used: without ``writeinto`` it
concatenates bytes (quadratic: 100 MB took 22 s), and with it the subscription has no callback,
so nats-py answers the server's flow-control requests from a 0.25 s polling task and the
transfer stalls (about 50 MB/s here). Reading the chunk subject with ``next_msg()``, which
answers flow control at once, is 4-8x faster. The chunks are the object store's own
(``$O.<bucket>.C.<nuid>``, ADR-20), so any NATS client can still read the objects.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import inspect
import os
import re
import shutil
import tempfile
import time
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions

from broker import Topology
from schemas import WeightUpdate, check_name, decode, encode_json

log = structlog.get_logger("agentarium.weights")

WEIGHTS_FILE = "model.safetensors"
MAX_CHUNK_SIZE = 1024 * 1024  # capped by the server's max_payload (1 MiB by default)
STALL_TIMEOUT_S = 30.0  # a fetch with no chunk for this long fails
_READ_SIZE = 8 * 1024 * 1024
_VERSION_DIR = re.compile(r"v(\d+)")


class WeightsError(Exception):
    """Root of the weight publishing and fetching errors.

    WeightsError
    ├── WeightNotFound            the version is not (or no longer) stored: wait for a newer one
    └── WeightVerificationError   the bytes differ from the WeightUpdate: never load them
    """


class WeightNotFound(WeightsError):
    """The object or shared file a WeightUpdate names does not exist (pruned, or unmounted)."""


class WeightVerificationError(WeightsError):
    """The fetched bytes do not match the WeightUpdate's size or sha256."""


def object_name(run: str, version: int) -> str:
    """The object-store name of a version: ``<run>/v<version>``."""
    return f"{check_name(run, 'run')}/v{int(version)}"


def is_shared_path(update: WeightUpdate) -> bool:
    """True when the update names a file on a shared filesystem rather than a stored object."""
    return os.path.isabs(update.object)


def sha256_file(path: Path) -> tuple[str, int]:
    """(lowercase hex sha256, size) of a file, read in 8 MiB blocks."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(_READ_SIZE):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


class WeightStore:
    """Publishes policy versions for the trainer and fetches them for the syncer.

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
        self.js = js
        self.topology = topology or Topology()
        self.weights_dir = Path(weights_dir).expanduser().resolve() if weights_dir else None
        self.keep_versions = keep_versions
        max_payload = getattr(getattr(js, "_nc", None), "max_payload", 0) or MAX_CHUNK_SIZE
        self.chunk_size = min(chunk_size or MAX_CHUNK_SIZE, max_payload)
        self.stall_timeout_s = stall_timeout_s
        self.published = 0
        self.fetched = 0
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
        kv = await self.js.key_value(self.topology.policy_bucket)
        await kv.put(run, encode_json(update))
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
            file, _ = await asyncio.to_thread(_materialize, model_or_dir, Path(tmp))
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
            file, owned = await asyncio.to_thread(_materialize, model_or_dir, stage / "save")
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

    # ---- read the policy KV ------------------------------------------------------------------

    async def latest(self, run: str) -> WeightUpdate | None:
        """The run's current WeightUpdate from the policy KV, or None before the first publish."""
        kv = await self.js.key_value(self.topology.policy_bucket)
        try:
            entry = await kv.get(check_name(run, "run"))
        except nats.js.errors.KeyNotFoundError:
            return None
        if not entry.value:
            return None
        return decode(WeightUpdate, entry.value)

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

    async def fetch(self, update: WeightUpdate, dest_dir: Path | str) -> Path:
        """Write the update's safetensors to ``dest_dir/model.safetensors`` and verify it.

        A file already there with the right sha256 is kept (a restarted syncer downloads
        nothing). Raises WeightNotFound, or WeightVerificationError (nothing left behind).
        """
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        final = dest_dir / WEIGHTS_FILE
        if final.is_file() and final.stat().st_size == update.size:
            sha, _ = await asyncio.to_thread(sha256_file, final)
            if sha == update.sha256:
                return final
        part = dest_dir / f".model.{uuid.uuid4().hex[:8]}.part"
        started = time.perf_counter()
        try:
            if is_shared_path(update):
                sha, size = await asyncio.to_thread(_copy_hashing, Path(update.object), part)
            else:
                sha, size = await self._download(update.object, part)
            _check(update, sha, size, where=update.object)
            os.replace(part, final)
        finally:
            part.unlink(missing_ok=True)
        self.fetched += 1
        log.info(
            "weights fetched",
            run=update.run,
            version=update.version,
            path=str(final),
            size=size,
            seconds=round(time.perf_counter() - started, 3),
        )
        return final

    async def _download(self, name: str, part: Path) -> tuple[str, int]:
        obs = await self.js.object_store(self.topology.weights_bucket)
        try:
            info = await obs.get_info(name)
        except nats.js.errors.NotFoundError as exc:  # ObjectNotFoundError is one of these
            raise WeightNotFound(
                f"weights {name!r} are not in the object store {self.topology.weights_bucket!r} "
                "(pruned already? raise the trainer's --keep-versions, or wait for the next "
                "version)"
            ) from exc
        if info.is_link():
            raise WeightsError(f"object {name!r} is a link; the trainer never publishes links")
        digest = hashlib.sha256()
        size = 0
        with open(part, "wb") as out:
            if info.size:
                subject = f"$O.{self.topology.weights_bucket}.C.{info.nuid}"
                sub = await self.js.subscribe(
                    subject, stream=f"OBJ_{self.topology.weights_bucket}", ordered_consumer=True
                )
                try:
                    while size < info.size:
                        try:
                            msg = await sub.next_msg(timeout=self.stall_timeout_s)
                        except nats.errors.TimeoutError as exc:
                            raise WeightsError(
                                f"fetching {name!r} stalled at {size} of {info.size} bytes for "
                                f"{self.stall_timeout_s:.0f} s: is the broker reachable?"
                            ) from exc
                        out.write(msg.data)
                        digest.update(msg.data)
                        size += len(msg.data)
                finally:
                    await sub.unsubscribe()
        stored = base64.urlsafe_b64decode((info.digest or "").partition("=")[2] or "")
        if size != info.size or (stored and stored != digest.digest()):
            raise WeightVerificationError(
                f"object {name!r} is corrupt: {size} bytes read, {info.size} stored, digest "
                f"{'matches' if stored == digest.digest() else 'differs'}; not loading it"
            )
        return digest.hexdigest(), size


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


def verify_file(path: Path | str, update: WeightUpdate) -> None:
    """Check a file against the update's size and sha256 (WeightVerificationError if not)."""
    path = Path(path)
    if not path.is_file():
        raise WeightNotFound(
            f"{str(path)!r} does not exist here: mount the trainer's --weights-dir at the same "
            "path on this machine, or publish through the object store"
        )
    sha, size = sha256_file(path)
    _check(update, sha, size, where=str(path))


def _check(update: WeightUpdate, sha: str, size: int, *, where: str) -> None:
    if size != update.size or sha != update.sha256:
        raise WeightVerificationError(
            f"weights {where!r} (run {update.run}, version {update.version}) fail verification: "
            f"sha256 {sha[:12]}…/{size} bytes, the WeightUpdate says "
            f"{update.sha256[:12]}…/{update.size} bytes; the file was not kept"
        )


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


def _copy_hashing(src: Path, dst: Path) -> tuple[str, int]:
    if not src.is_file():
        raise WeightNotFound(
            f"{str(src)!r} does not exist here: mount the trainer's --weights-dir at the same "
            "path on this machine, or publish through the object store"
        )
    digest = hashlib.sha256()
    size = 0
    with open(src, "rb") as f, open(dst, "wb") as out:
        while block := f.read(_READ_SIZE):
            digest.update(block)
            out.write(block)
            size += len(block)
    return digest.hexdigest(), size


def _materialize(model_or_dir: Any, scratch: Path) -> tuple[Path, bool]:
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


def local_versions(run_dir: Path | str) -> list[int]:
    """Versions present as ``v<N>`` directories under ``run_dir``, ascending."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = _VERSION_DIR.fullmatch(child.name)
        if match and child.is_dir():
            found.append(int(match.group(1)))
    return sorted(found)
