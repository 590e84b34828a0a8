"""Checkpoints: model, optimizer, step, version, RNG and the job ids trained since the last one.

Layout under ``--checkpoint-dir``::

    step-00000010/
        model.safetensors     the policy's state dict (no pickle)
        optimizer.pt          AdamW state (torch.save; loaded with weights_only=True)
        shards/               instead of the two above, a sharded trainer's (--parallel fsdp)
                              model and optimizer as torch.distributed.checkpoint wrote them:
                              each rank its own shards, rank 0 the .metadata
        rng.pt                torch CPU (and CUDA) RNG states
        state.json            step, version, run, agent, seed, python RNG, job ids, counters
    config.yaml               the settings of the latest start (a file `agentarium trainer
                              --config` reads back)

A checkpoint is written into a private temporary directory, fsynced, then renamed into place:
a directory named ``step-*`` with a ``state.json`` is complete, whatever killed the writer.
Pruning keeps the newest ``keep`` checkpoints whole and only deletes the weight files of older
ones: their ``state.json`` stays, because the job id lists of every checkpoint together say
which trajectories have been trained (the dedup set of a resumed trainer, and the test's
exactly-once check).
"""

from __future__ import annotations

import json
import os
import pickle  # for UnpicklingError only: a weights_only load refusing a payload raises it
import random
import shutil
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch
import yaml
from safetensors.torch import load_file, save_file

from .errors import CheckpointError
from .prometheus import CHECKPOINT_SECONDS

log = structlog.get_logger("agentarium.trainer")

_PREFIX = "step-"
CONFIG = "config.yaml"
_WEIGHT_FILES = ("model.safetensors", "optimizer.pt", "rng.pt")
SHARDS = "shards"  # a sharded trainer's torch.distributed.checkpoint directory


@dataclass(frozen=True)
class Loaded:
    """A checkpoint read back; ``model_state`` and ``optimizer_state`` are empty for a sharded
    one (``sharded``: the ranks read ``path / SHARDS`` themselves)."""

    path: Path
    state: dict
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict
    rng: dict

    @property
    def sharded(self) -> bool:
        return (self.path / SHARDS).is_dir()

    def full_states(self) -> tuple[dict[str, torch.Tensor], dict]:
        """The model and optimizer states of a replicated trainer's checkpoint."""
        if self.sharded:
            raise CheckpointError(
                f"checkpoint {self.path} is sharded (written with --parallel fsdp): resume it "
                "with --parallel fsdp (or start a new checkpoint directory)"
            )
        return self.model_state, self.optimizer_state

    @property
    def step(self) -> int:
        return int(self.state["step"])

    @property
    def version(self) -> int:
        return int(self.state["version"])


class Checkpoints:
    """A checkpoint directory, written every ``every`` steps (the trainer acks what each one
    covers)."""

    def __init__(self, directory: str | Path, *, keep: int = 3, every: int = 1) -> None:
        assert keep >= 1, "keep at least one checkpoint"
        self.directory = Path(directory)
        self.keep = keep
        self.every = every
        self.last: Path | None = None  # written by this process

    def __repr__(self) -> str:
        return f"<Checkpoints {self.directory} keep={self.keep} every={self.every}>"

    def due(self, step: int) -> bool:
        return step % self.every == 0

    # ---- reading -----------------------------------------------------------------------
    def steps(self) -> list[Path]:
        """Complete checkpoint directories, oldest first."""
        if not self.directory.is_dir():
            return []
        found = [
            p
            for p in self.directory.iterdir()
            if p.is_dir() and p.name.startswith(_PREFIX) and (p / "state.json").is_file()
        ]
        return sorted(found, key=lambda p: int(p.name[len(_PREFIX) :]))

    def history(self) -> list[dict]:
        """Every checkpoint's state.json, oldest first (pruned ones included)."""
        return [self._state(p) for p in self.steps()]

    def seen_job_ids(self) -> set[str]:
        """Job ids trained or consumed by any checkpointed step."""
        seen: set[str] = set()
        for state in self.history():
            seen.update(state["trained_job_ids"])
            seen.update(state["consumed_job_ids"])
        return seen

    def latest(self) -> Path | None:
        whole = [p for p in self.steps() if _has_weights(p)]
        return whole[-1] if whole else None

    def load(self, path: Path, *, map_location: str | torch.device = "cpu") -> Loaded:
        model_state: dict[str, torch.Tensor] = {}
        optimizer_state: dict = {}
        try:
            state = self._state(path)
            if not (path / SHARDS).is_dir():
                model_state = load_file(str(path / "model.safetensors"), device=str(map_location))
                optimizer_state = torch.load(
                    path / "optimizer.pt", map_location=map_location, weights_only=True
                )
            rng = torch.load(path / "rng.pt", weights_only=True)
        except (OSError, ValueError, RuntimeError, KeyError, pickle.UnpicklingError) as exc:
            raise CheckpointError(
                f"checkpoint {path} is unreadable ({exc}): delete it to resume from the one "
                "before, or start without --resume"
            ) from exc
        return Loaded(path, state, model_state, optimizer_state, rng)

    def _state(self, path: Path) -> dict:
        try:
            return json.loads((path / "state.json").read_text())
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"checkpoint {path}: state.json unreadable ({exc})") from exc

    # ---- writing -----------------------------------------------------------------------
    def snapshot(
        self,
        write: Callable[[Path], None],
        *,
        run: str,
        groups: int,
        **fields: Any,
    ) -> Path:
        """``save`` what ``write(directory)`` writes there (an updater's model and optimizer:
        ``write_full`` or a sharded trainer's shards), with ``fields`` (``save``'s), timed for
        /metrics and logged (``groups``: how many it covers)."""
        started = time.monotonic()
        path = self.save(write=write, **fields)
        self.last = path
        CHECKPOINT_SECONDS.labels(run).observe(time.monotonic() - started)
        log.info(
            "checkpoint saved",
            step=fields["step"],
            version=fields["version"],
            path=str(path),
            groups=groups,
        )
        return path

    def save(
        self,
        *,
        step: int,
        version: int,
        trained_job_ids: Iterable[str],
        consumed_job_ids: Iterable[str],
        model_state: dict[str, torch.Tensor] | None = None,
        optimizer_state: dict | None = None,
        write: Callable[[Path], None] | None = None,
        extra: dict | None = None,
    ) -> Path:
        """Write one checkpoint atomically and prune old weights; returns its directory. The
        weights are ``write(directory)``'s, else ``model_state`` and ``optimizer_state``."""
        if write is None:
            assert model_state is not None and optimizer_state is not None, "weights to write"
            full_model, full_optimizer = model_state, optimizer_state

            def write(directory: Path) -> None:
                write_full(directory, full_model, full_optimizer)

        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"{_PREFIX}{step:08d}"
        if final.exists():
            raise CheckpointError(f"checkpoint {final} exists already: two trainers on one run?")
        tmp = self.directory / f".{final.name}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        try:
            write(tmp)
            rng: dict[str, torch.Tensor | list[torch.Tensor]] = {"torch": torch.get_rng_state()}
            if torch.cuda.is_available():
                rng["cuda"] = torch.cuda.get_rng_state_all()
            torch.save(rng, tmp / "rng.pt")
            state = {
                "step": step,
                "version": version,
                "created_at": time.time(),
                "python_rng": _python_rng(),
                "trained_job_ids": list(trained_job_ids),
                "consumed_job_ids": list(consumed_job_ids),
                **(extra or {}),
            }
            (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n")
            for path in tmp.rglob("*"):
                _fsync(path)
            _fsync(tmp)
            os.rename(tmp, final)
            _fsync(self.directory)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self._prune()
        return final

    def write_config(self, values: Mapping[str, Any], header: str = "") -> list[str]:
        """Write ``config.yaml`` (replacing it atomically); returns the keys whose values differ
        from the file it replaces (none for a first start)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / CONFIG
        plain = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
        try:
            before = yaml.safe_load(path.read_text()) if path.is_file() else None
        except (OSError, yaml.YAMLError):
            before = None  # unreadable: replaced, and nothing to compare with
        changed = (
            sorted(k for k in {*before, *plain} if before.get(k) != plain.get(k))
            if isinstance(before, dict)
            else []
        )
        comment = "".join(f"# {line}\n" for line in header.splitlines())
        tmp = path.with_name(f".{CONFIG}.tmp-{os.getpid()}")
        tmp.write_text(comment + yaml.safe_dump(plain, sort_keys=False, allow_unicode=True))
        os.replace(tmp, path)
        return changed

    def clean_partial(self) -> None:
        """Remove temporary directories a killed writer left behind."""
        if self.directory.is_dir():
            for path in self.directory.glob(f".{_PREFIX}*.tmp-*"):
                shutil.rmtree(path, ignore_errors=True)

    def _prune(self) -> None:
        whole = [p for p in self.steps() if _has_weights(p)]
        for path in whole[: -self.keep]:
            for name in _WEIGHT_FILES:
                (path / name).unlink(missing_ok=True)
            shutil.rmtree(path / SHARDS, ignore_errors=True)


class NoCheckpoints:
    """No checkpoint directory: nothing is written or resumed, and every step is "due", so
    its trajectories are acked right after it."""

    directory = None
    last = None

    def __repr__(self) -> str:
        return "<NoCheckpoints>"

    def due(self, step: int) -> bool:
        return True

    def clean_partial(self) -> None:
        pass

    def latest(self) -> Path | None:
        return None

    def seen_job_ids(self) -> set[str]:
        return set()

    def load(self, path: Path) -> Loaded:
        raise AssertionError("NoCheckpoints has no checkpoint to load (latest() is None)")

    def write_config(self, values: Mapping[str, Any], header: str = "") -> list[str]:
        return []

    def snapshot(
        self, write: Callable[[Path], Any], *, run: str, groups: int, **fields: Any
    ) -> None:
        return None  # nothing is even written


def write_full(
    directory: Path, model_state: dict[str, torch.Tensor], optimizer_state: dict
) -> None:
    """A replicated trainer's weights: ``model.safetensors`` and ``optimizer.pt``."""
    save_file(_unshared(model_state), str(directory / "model.safetensors"))
    torch.save(optimizer_state, directory / "optimizer.pt")


def _has_weights(path: Path) -> bool:
    """The checkpoint still holds its weights (pruning keeps state.json alone)."""
    return (path / "model.safetensors").is_file() or (path / SHARDS / ".metadata").is_file()


def restore_rng(rng: dict, state: dict) -> None:
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])
    version, internal, gauss = state["python_rng"]
    random.setstate((version, tuple(internal), gauss))


def _python_rng() -> list:
    version, internal, gauss = random.getstate()
    return [version, list(internal), gauss]


def _unshared(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """safetensors refuses tensors sharing memory (tied embeddings): store a copy of each."""
    out, seen = {}, set()
    for name, tensor in state.items():
        tensor = tensor.detach().cpu()
        key = tensor.untyped_storage().data_ptr()
        out[name] = tensor.clone() if key in seen else tensor.contiguous()
        seen.add(key)
    return out


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
