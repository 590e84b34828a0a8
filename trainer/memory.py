"""``--memory``: the trainer's memory plan, chosen from the model's size unless named.

A step holds the weights, their gradients and AdamW's two moments (16 bytes a trained
parameter in fp32), and a pass's activations on top. For a model the size of SmolLM2-135M
that is 2.15 GB before the first activation, and the activations of a whole batch in one pass
(16 rows of GRPO, 3,400 tokens) are 4-5 GB more: 6.9 GB of RSS for one step
(docs/benchmarks.md, "Trainer step padded vs packed"). Two plans:

- ``fast``: the settings as given (no checkpointing, fp32 moments, the batch in one pass unless
  ``--max-tokens-per-micro-batch`` / ``--micro-batch-size`` split it);
- ``small``: activation checkpointing on, AdamW's moments in 3 bytes a parameter
  (``--optimizer-state fp8``, trainer/optim.py) where they may be (fp32 weights, a replicated
  trainer), passes of at most ``SMALL_TOKENS`` real tokens when no limit was set, log-probs
  ``SMALL_CHUNK`` positions at a time at most (``LONG_PASS_CHUNK`` in a pass whose layers run
  sliced: ``step.head_chunk``), a longer pass's feed-forward blocks
  ``SMALL_MLP_CHUNK`` positions at a time (``--mlp-chunk``, trainer/chunked_mlp.py: a row
  longer than a pass's budget runs alone) and its layers ``SMALL_LAYER_CHUNK`` at a time
  (``--layer-chunk``, a replicated trainer's), on jemalloc (trainer/heap.py).

  What a step holds for SmolLM2 beside its pass: the weights (513 MiB), their gradients (513,
  from the first pass's backward), the moments (387, from the first update on), torch and
  the libraries (about 290) and about 50 that jemalloc counts as allocated between steps while
  no tensor holds them (measured: docs/benchmarks.md, "The defaults on an AVX-512 machine").
  That leaves a pass about 160 MiB under 2 GiB, so the pass budget and the chunks are small:
  256-token passes and 32-position chunks held the 16-row step at 1,991 MiB from the second
  step on where 512 and 64 held it at 2,057 and 1,024 and 128 at 2,244, at 14 % more time a
  step than 1,024 and 128 (30.4 s against 26.6 s). Since the head's chunk is taken in place
  (trainer/logprobs.py: its logits become log-probs, probabilities and gradient in one (n, V)
  tensor), 128-position chunks cost what 32 did before within a few tens of MiB and run the
  head's matrix products about a fifth faster (docs/benchmarks.md). One 8,192-token row among short ones, alone
  in its pass, runs its layers ``SMALL_LAYER_CHUNK`` positions at a time and keeps every
  second layer's input (``--layer-chunk``, trainer/sliced_layers.py): 2,020-2,036 MiB at the
  second step in two runs, where whole layers held 2,388-2,434 (the 540 MiB of their inputs
  and a layer's 460 MiB of recomputation beside the moments).

``auto`` (the default) is ``small`` when every weight of a model of ``SMALL_FROM`` parameters or
more is trained (counted in its safetensors files' headers), and ``fast`` otherwise: LoRA
adapters (a few MB of gradients and moments, the base frozen) and small models, whose steps
are short and whose memory is not the bound (the tiny model's demo).
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

MEMORY_PLANS = ("auto", "fast", "small")
SMALL_FROM = 100_000_000  # parameters: SmolLM2-135M and up
SMALL_TOKENS = 256  # real tokens a pass, when no limit was set
SMALL_CHUNK = 128  # log-prob positions at a time, at most
# ... in a pass whose layers run sliced (more real tokens than its layer chunk): it holds its
# layers' inputs through the head's backward, so the head's (chunk, V) tensor stays small there
LONG_PASS_CHUNK = 32
SMALL_MLP_CHUNK = 512  # feed-forward positions at a time in a longer pass (trainer/chunked_mlp.py)
SMALL_LAYER_CHUNK = 512  # a layer's positions at a time in a longer pass (trainer/sliced_layers.py)
# the header of a safetensors file: an 8-byte little-endian length, then that many bytes of JSON
_HEADER_LIMIT = 100 * 2**20


def checkpoint_parameters(model_dir: str | Path) -> int | None:
    """The parameters stored in ``model_dir``'s safetensors files (every shard; a tied weight
    is stored once), read from their headers; None where there are none or one is unreadable."""
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        return None
    total = 0
    try:
        for file in files:
            with file.open("rb") as f:
                (length,) = struct.unpack("<Q", f.read(8))
                if length > _HEADER_LIMIT:
                    return None
                header = json.loads(f.read(length))
            total += sum(
                math.prod(entry["shape"])
                for name, entry in header.items()
                if name != "__metadata__"
            )
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None
    return total


def plan_for(memory: str, *, lora_rank: int, model_dir: str | Path) -> str:
    """``fast`` or ``small``: ``memory`` itself unless it is ``auto`` (the module docstring)."""
    if memory != "auto":
        return memory
    if lora_rank > 0:
        return "fast"
    params = checkpoint_parameters(model_dir)
    return "small" if params is not None and params >= SMALL_FROM else "fast"


def step_values(values: dict[str, Any], plan: str, *, dtype: str, parallel: str) -> dict[str, Any]:
    """A step's settings (``StepSettings``' fields) under ``plan``, ``optimizer_state`` "auto"
    resolved: fp8 under ``small`` where fp8 moments may be (fp32 weights, not FSDP shards)."""
    values = dict(values)
    small = plan == "small"
    if values["optimizer_state"] == "auto":
        fits = dtype == "float32" and parallel != "fsdp"
        values["optimizer_state"] = "fp8" if small and fits else "fp32"
    if small:
        values["activation_checkpointing"] = True
        if values["max_tokens_per_micro_batch"] == 0 and values["micro_batch_size"] == 0:
            values["max_tokens_per_micro_batch"] = SMALL_TOKENS
        if values["logprob_chunk"] > SMALL_CHUNK:
            values["logprob_chunk"] = SMALL_CHUNK
        if values["mlp_chunk"] == 0:
            values["mlp_chunk"] = SMALL_MLP_CHUNK
        if values["layer_chunk"] == 0 and parallel != "fsdp":  # sharded layers run whole
            values["layer_chunk"] = SMALL_LAYER_CHUNK
    return values
