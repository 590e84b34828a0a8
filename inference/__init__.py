"""The inference side: the engines and the weight flow into them, in one place.

- ``control.py``: ``EngineControl``, the one client of an engine's control API (SGLang's and the
  local engine's), with one error contract (``EngineControlError``);
- ``engines.py``: the engine registry (the engines KV bucket) and the version each one serves;
- ``weights.py``: published weight files: fetching, checksums, verification, local versions;
- ``engine/``: the local CPU engine (``agentarium engine``), SGLang's HTTP API on torch;
- ``sync/``: the weight syncer (``agentarium sync``), which keeps every engine on the latest
  policy version;
- ``vllm.py``: vLLM as an engine (its virtualenv, the command line that serves a model the way
  the consumers and the syncer speak to it: ``agentarium engine --backend vllm``).

The weight flow reads here: the trainer publishes a version (``weights.py``'s files, a
``WeightUpdate`` on NATS), the syncer fetches and verifies it and reloads each engine through
``EngineControl``, and ``engines.py`` records what each engine serves. This face is light (no
torch): the consumers and the trainer use the client, the registry and the weight files; the
two services, ``engine`` and ``sync``, are started only by the ``agentarium`` commands.
"""

from .control import PAUSE_MODES, EngineControl, EngineControlError, weights_checksum
from .engines import (
    FRESH_S,
    engine_key,
    engine_versions,
    record_engine,
    served_version,
    wait_served,
)
from .vllm import VllmUnavailable, has_gpu, max_lora_rank, vllm_command, vllm_python
from .weights import (
    LORA_CONFIG_KEY,
    STALL_TIMEOUT_S,
    WEIGHTS_FILE,
    WeightFetcher,
    WeightNotFound,
    WeightsError,
    WeightVerificationError,
    adapter_directory,
    default_weights_dir,
    is_shared_path,
    local_versions,
    lora_config_of,
    object_name,
    sha256_file,
    verify_file,
)

__all__ = [
    "LORA_CONFIG_KEY",
    "PAUSE_MODES",
    "STALL_TIMEOUT_S",
    "WEIGHTS_FILE",
    "EngineControl",
    "EngineControlError",
    "WeightFetcher",
    "WeightNotFound",
    "WeightVerificationError",
    "WeightsError",
    "adapter_directory",
    "default_weights_dir",
    "engine_key",
    "engine_versions",
    "FRESH_S",
    "has_gpu",
    "is_shared_path",
    "local_versions",
    "lora_config_of",
    "max_lora_rank",
    "object_name",
    "record_engine",
    "served_version",
    "sha256_file",
    "verify_file",
    "vllm_command",
    "vllm_python",
    "VllmUnavailable",
    "wait_served",
    "weights_checksum",
]
