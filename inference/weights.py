"""Reading published weights: the policy KV's current WeightUpdate, and a version's safetensors
fetched to a local directory and verified (the weight syncer's side; trainer/weights.py
publishes). In inference's face because the syncer (``inference.sync``) and the trainer (its
resume, its publisher's own reads) both need it, and the trainer may not import the syncer.

``WeightFetcher.fetch`` streams the chunks into ``<dest>/.model.*.part``, hashing as it
writes, checks size and sha256 against the WeightUpdate, and only then renames the file to
``<dest>/model.safetensors``; a mismatch deletes the file and raises WeightVerificationError.
nats-py's ``ObjectStore.get()`` is not used: without ``writeinto`` it concatenates bytes
(quadratic: 100 MB took 22 s), and with it the subscription has no callback, so nats-py
answers the server's flow-control requests from a 0.25 s polling task and the transfer stalls
(about 50 MB/s here). Reading the chunk subject with ``next_msg()``, which answers flow
control at once, is 4-8x faster. The chunks are the object store's own
(``$O.<bucket>.C.<nuid>``, ADR-20), so any NATS client can still read the objects.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from pathlib import Path

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext

from agentarium.broker import Topology
from agentarium.schemas import WeightUpdate, check_name, decode

log = structlog.get_logger("agentarium.weights")

WEIGHTS_FILE = "model.safetensors"
# A LoRA adapter published in place of whole weights (the trainer's --lora-rank) carries its
# PEFT adapter config, as JSON, under this key of the safetensors header's metadata.
LORA_CONFIG_KEY = "agentarium.lora_config"
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


def default_weights_dir() -> Path:
    """``$AGENTARIUM_HOME/weights`` (default ``~/.cache/agentarium/weights``)."""
    home = os.environ.get("AGENTARIUM_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "agentarium"
    return base / "weights"


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


class WeightFetcher:
    """Reads a run's current WeightUpdate and fetches versions from the object store (or a
    shared path); trainer/weights.py's WeightStore adds publishing."""

    def __init__(
        self,
        js: JetStreamContext,
        topology: Topology | None = None,
        *,
        stall_timeout_s: float = STALL_TIMEOUT_S,
    ) -> None:
        self.js = js
        self.topology = topology or Topology()
        self.stall_timeout_s = stall_timeout_s
        self.fetched = 0

    def __repr__(self) -> str:
        return f"<WeightFetcher {self.topology.weights_bucket} fetched={self.fetched}>"

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


def lora_config_of(path: str | Path) -> dict | None:
    """The PEFT adapter config a published safetensors file carries (``LORA_CONFIG_KEY``), or
    None for whole weights. Reads the header alone (8 bytes of length, then JSON)."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        if not 0 < size <= 100 * 1024 * 1024:
            raise WeightsError(f"{str(path)!r} is not a safetensors file (header of {size} bytes)")
        header = json.loads(f.read(size))
    text = (header.get("__metadata__") or {}).get(LORA_CONFIG_KEY)
    return None if text is None else json.loads(text)


def adapter_directory(file: str | Path, directory: str | Path) -> Path:
    """A PEFT adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``, a
    hard link or copy of ``file``) made from a published LoRA adapter file, for
    ``/load_lora_adapter`` and peft's loaders."""
    config = lora_config_of(file)
    if config is None:
        raise WeightsError(f"{str(file)!r} holds whole weights, not a LoRA adapter")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=1) + "\n")
    target = directory / "adapter_model.safetensors"
    target.unlink(missing_ok=True)
    try:
        os.link(file, target)
    except OSError:  # another filesystem
        shutil.copyfile(file, target)
    return directory
