"""The local inference engine: SGLang's native HTTP API on torch + transformers, on the CPU.

It serves any local transformers model directory (the built-in tiny model included) with
continuous batching, token-level logprobs, streamed responses (SGLang's incremental chunks),
pause/continue, in-place weight reloads from disk and weights received over torch.distributed
(SGLang's distributed weight update, gloo), so the weight syncer and the tracing client have
one code path for it and for SGLang.

Reported logprobs are log_softmax(logits / temperature) of each sampled token, before any
top_p/top_k/min_p truncation (SGLang's default); greedy requests report temperature 1. At
temperature 1 they are the model's own log-probabilities, as the trainer recomputes them.
"""

from __future__ import annotations

import importlib
from typing import Any

from .config import EngineSettings
from .errors import EngineError, InvalidRequest, WeightLoadError

# torch + transformers load on first use, so the CLI reads EngineSettings without them
_LAZY = {
    "LocalEngine": ".engine",
    "RunningServer": ".server",
    "make_app": ".server",
    "serve": ".server",
    "start_server": ".server",
}

__all__ = [
    "EngineError",
    "EngineSettings",
    "InvalidRequest",
    "LocalEngine",
    "RunningServer",
    "WeightLoadError",
    "make_app",
    "serve",
    "start_server",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'agentarium.inference.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value
