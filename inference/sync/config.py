"""SyncConfig: what one weight syncer keeps in step, declared once (flags of `agentarium sync`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentarium.schemas import check_name, check_settings, setting

from ..control import PAUSE_MODES
from ..weights import default_weights_dir


@dataclass(frozen=True, kw_only=True)
class SyncConfig:
    """A run, its engines, and where weights land on disk."""

    run: str = setting(help="run id whose policy versions to follow")
    engines: tuple[str, ...] = setting(
        flag="--engine",
        metavar="URL",
        help="engine base URL (SGLang or the local engine), e.g. http://127.0.0.1:30000; "
        "repeat for every engine that shares this machine's disk",
    )
    weights_dir: Path | None = setting(
        None,
        metavar="DIR",
        parse=Path,
        help="local directory the engines read new weights from, as DIR/RUN/vN/"
        "model.safetensors (default $AGENTARIUM_HOME/weights, i.e. ~/.cache/agentarium/weights)",
    )
    shared_path: bool = setting(
        False,
        help="the trainer publishes to a shared filesystem (its --weights-dir) mounted at the "
        "same path here: verify and load those files in place instead of copying them into "
        "--weights-dir",
    )
    shared_engines: bool = setting(
        False,
        help="these engines serve several runs: never load this run's weights over another "
        "run's; stop with an error naming both runs instead (default: this run takes its "
        "engines over, whatever they served before)",
    )
    base_model: Path | None = setting(
        None,
        metavar="DIR",
        parse=Path,
        help="the engines' original model directory (on this disk), loaded to restore the base "
        "weights when this run takes over engines that serve another run's and has published "
        "no version yet, or trains a LoRA adapter (default: the engine's /model_info "
        "tokenizer_path, when it holds *.safetensors)",
    )
    keep: int = setting(
        2,
        ge=1,
        metavar="K",
        help="local versions to keep in --weights-dir (the loaded one always is)",
    )
    pause_mode: str = setting(
        "in_place",
        choices=PAUSE_MODES,
        help="how /pause_generation holds requests during a reload",
    )
    recheck_s: float = setting(
        30.0,
        gt=0,
        flag="--recheck-s",
        metavar="S",
        help="also re-read the policy KV and re-check every engine's version this often, to "
        "catch a restarted engine or a lost watch",
    )
    update_timeout_s: float = setting(
        600.0,
        gt=0,
        flag="--update-timeout-s",
        metavar="S",
        help="longest wait for one engine's /update_weights_from_disk",
    )

    def __post_init__(self) -> None:
        check_name(self.run, "run")
        if not self.engines:
            raise ValueError("give at least one --engine URL (e.g. http://127.0.0.1:30000)")
        for url in self.engines:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"engine URL {url!r} needs http:// or https://")
        check_settings(self)
        # the one place the default directory is chosen, absolute so log lines and the
        # engines' model_path agree whatever the working directory (frozen: set it once here)
        if self.base_model is not None:
            base = Path(self.base_model).expanduser().resolve()
            if not base.is_dir() or not any(base.glob("*.safetensors")):
                raise ValueError(
                    f"--base-model {str(self.base_model)!r} is not a directory holding "
                    "*.safetensors (the engines' original model directory, on this disk)"
                )
            object.__setattr__(self, "base_model", base)
        directory = Path(self.weights_dir) if self.weights_dir else default_weights_dir()
        object.__setattr__(self, "weights_dir", directory.expanduser().resolve())

    @property
    def directory(self) -> Path:
        """``weights_dir``, always set once built."""
        assert self.weights_dir is not None
        return self.weights_dir

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["weights_dir"] = str(self.weights_dir)
        out["base_model"] = None if self.base_model is None else str(self.base_model)
        out["engines"] = list(self.engines)
        return out
