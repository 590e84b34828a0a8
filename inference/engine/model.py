"""The engine's model: a transformers causal LM and its tokenizer, batched forward passes over a
left-padded KV cache, in-place weight reloads from safetensors, and swaps of received tensors.

Everything here is synchronous and runs on the scheduler's worker thread; the scheduler makes
sure a forward pass and a weight reload never overlap.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from pathlib import Path
from typing import Any

import structlog
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from .errors import WeightLoadError
from .kv import PaddedKV
from .prefix_cache import CachedPrefix

log = structlog.get_logger("agentarium.engine")


PREFILL_MASK_BYTES = 256 * 2**20


class EngineModel:
    """A local transformers model directory, loaded for batched CPU inference."""

    def __init__(self, model_path: Path, *, threads: int = 1) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

        if threads > 0:
            torch.set_num_threads(threads)
        self.model_path = Path(model_path)
        self.config = AutoConfig.from_pretrained(self.model_path)
        with _quiet_progress_bars():
            self.model = AutoModelForCausalLM.from_pretrained(
                self.model_path, dtype=torch.float32, attn_implementation="sdpa"
            )
        self.model.eval()
        self.tokenizer = _load_tokenizer(self.model_path)
        text_config = self.config.get_text_config()
        self.vocab_size = int(text_config.vocab_size)
        self.context_len = int(getattr(text_config, "max_position_embeddings", 0) or 32768)
        self.eos_token_ids = _eos_token_ids(self.model_path, text_config)
        self._cache_cls = DynamicCache
        params = inspect.signature(self.model.forward).parameters
        # transformers 5.x renamed past_key_values to cache (the old name warns until 5.40).
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"
        self._pad_id = int(self.config.pad_token_id or 0) % self.vocab_size
        # the most one prefill pass's attention mask may take (see _chunks)
        self.prefill_mask_bytes = PREFILL_MASK_BYTES

    # ---- forward passes -------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(
        self,
        prompts: list[list[int]],
        *,
        all_logits: bool,
        prefixes: list[CachedPrefix | None] | None = None,
    ) -> tuple[torch.Tensor, PaddedKV]:
        """Run prompts (left-padded into one batch) through the model.

        ``prefixes[i]``, when given, holds the KV of prompt i's first ``length`` tokens (the
        prefix cache): only the rest of the prompt is computed, after it. Returns logits
        (B, T, V) over every computed position when `all_logits` (no prefixes then), else
        (B, 1, V) for the last position only, and the prompts' KV cache: each row its cached
        columns right-aligned, then its computed ones (padding between is masked).
        """
        cached = [0 if p is None else p.length for p in (prefixes or [None] * len(prompts))]
        assert not (all_logits and any(cached)), "logits of every position need no prefix"
        fresh = [prompt[n:] for prompt, n in zip(prompts, cached, strict=True)]
        width = max(len(p) for p in fresh)
        ids = torch.full((len(prompts), width), self._pad_id, dtype=torch.long)  # (B, T)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)  # (B, T)
        for row, prompt in enumerate(fresh):
            ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            mask[row, width - len(prompt) :] = 1
        positions = (mask.cumsum(1) - 1).clamp(min=0) + torch.tensor(cached)[:, None]  # (B, T)
        if any(cached):
            past = _past_kv(prefixes or [], cached)
            mask = torch.cat([past.mask, mask], dim=1)  # (B, P + T)
            cache = self._cache_cls(list(zip(past.keys, past.values, strict=True)))
            del past  # the cache holds them until the forward pass extends them
        else:
            cache = self._cache_cls()
        past_width = mask.shape[1] - width
        logits = []
        for start, end in self._chunks(len(prompts), past_width, width, masked=bool(any(cached))):
            out = self.model(
                input_ids=ids[:, start:end],
                attention_mask=mask[:, : past_width + end],
                position_ids=positions[:, start:end],
                use_cache=True,
                logits_to_keep=0 if all_logits else 1,
                **{self._cache_kwarg: cache},
            )
            if all_logits or end == width:
                logits.append(out.logits)
        keys, values = _cache_tensors(cache)
        kv = PaddedKV(keys=keys, values=values, mask=mask)
        kv.zero_padding()
        return torch.cat(logits, dim=1).float(), kv

    def _chunks(self, rows: int, past: int, width: int, *, masked: bool) -> list[tuple[int, int]]:
        """The column ranges one prefill computes in turn. A pass of T new columns after P
        cached ones, under a mask that is not all ones (padded rows, a cached prefix), builds
        a (B, 1, T, P + T) float mask: 1.1 GB for 12k tokens after 12k, and a harness's
        78k-token call grew the engine to 23 GB before the kernel killed it. Split so each
        pass stays under ``prefill_mask_bytes``; a pass without padding or prefix
        (transformers drops the mask) is one pass, as is any pass under the bound."""
        if not masked and rows == 1:
            return [(0, width)]
        step = width
        while step > 1 and rows * step * (past + width) * 4 > self.prefill_mask_bytes:
            step = (step + 1) // 2
        return [(start, min(start + step, width)) for start in range(0, width, step)]

    @torch.inference_mode()
    def decode(self, kv: PaddedKV, tokens: list[int], positions: list[int]) -> torch.Tensor:
        """One decode step: feed each row its last token; `kv` grows by one column in place.

        Returns logits (B, V).
        """
        ids = torch.tensor(tokens, dtype=torch.long)[:, None]  # (B, 1)
        pos = torch.tensor(positions, dtype=torch.long)[:, None]  # (B, 1)
        keys, values = kv.make_room(1)
        width = kv.keys[0].shape[2]
        kv.append_column()
        cache = self._cache_cls()  # its layers write the new column into kv's buffers
        layer = in_place_layer()
        cache.layers = [layer(k, v, width) for k, v in zip(keys, values, strict=True)]
        out = self.model(
            input_ids=ids,
            attention_mask=kv.mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_kwarg: cache},
        )
        kv.keys, kv.values = _cache_tensors(cache)
        return out.logits[:, -1].float()

    # ---- weights --------------------------------------------------------------------------

    def load_weights(self, path: Path) -> str:
        """Copy the safetensors weights under `path` into the live module (same architecture).

        Raises WeightLoadError, leaving the current weights untouched, when the files are
        missing or do not fit this model.
        """
        path = Path(path)
        if not path.is_dir():
            raise WeightLoadError(f"model_path {str(path)!r} is not a directory")
        self._check_config(path)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"no *.safetensors file in {str(path)!r}")
        state: dict[str, torch.Tensor] = {}
        for file in files:
            state.update(load_file(str(file)))
        current = self.model.state_dict()
        if set(state) - set(current):
            # the checkpoint's names are not the module's: a checkpoint format transformers
            # converts on load (a mixture's experts, one tensor each in the checkpoint, are
            # fused 3-D parameters in the module): load it as transformers does
            state = self._converted(path, files)
        unexpected = sorted(set(state) - set(current))
        missing = sorted(set(current) - set(state) - self._derived_keys())
        if unexpected or missing:
            raise WeightLoadError(
                f"weights in {str(path)!r} do not fit the served model "
                f"({type(self.model).__name__}): missing {missing[:5]}, unexpected {unexpected[:5]}"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(current[name].shape):
                raise WeightLoadError(
                    f"weights in {str(path)!r} do not fit the served model: {name} has shape "
                    f"{tuple(tensor.shape)}, the served model {tuple(current[name].shape)}"
                )
        with torch.no_grad():
            for name, tensor in state.items():
                current[name].copy_(tensor.to(current[name].dtype))
        self.model_path = path
        return f"Succeeded to update model weights from {path} ({len(state)} tensors)."

    def _converted(self, path: Path, files: list[Path]) -> dict[str, torch.Tensor]:
        """``files``' weights under the module's names, read by transformers' own loader (its
        checkpoint conversions) into a second model of this architecture (memory for one more
        copy, for the time of the load); the state as it was read when it refuses them."""
        import tempfile

        with tempfile.TemporaryDirectory(prefix="agentarium-weights-") as scratch:
            where = Path(scratch)
            self.config.save_pretrained(where)
            for file in [*files, *path.glob("*.safetensors.index.json")]:
                (where / file.name).symlink_to(file.resolve())
            try:
                out: Any = type(self.model).from_pretrained(
                    where, dtype=self.model.dtype, output_loading_info=True
                )
                loaded, info = out  # the model and what it found and missed
            except (OSError, ValueError, RuntimeError) as exc:
                raise WeightLoadError(
                    f"weights in {str(path)!r} do not fit the served model "
                    f"({type(self.model).__name__}), nor does transformers convert them: "
                    f"{str(exc).splitlines()[0][:300]}"
                ) from exc
        # transformers fills what a checkpoint lacks with a fresh draw: never serve that
        missing = sorted(set(info.get("missing_keys") or ()) - self._derived_keys())
        unfit = sorted(set(info.get("unexpected_keys") or ()) | set(info.get("mismatched_keys") or ()))  # fmt: skip
        if missing or unfit:
            raise WeightLoadError(
                f"weights in {str(path)!r} do not fit the served model "
                f"({type(self.model).__name__}): missing {missing[:5]}, unexpected {unfit[:5]}"
            )
        return loaded.state_dict()

    def streamable(self) -> dict[str, torch.Tensor]:
        """The tensors a weight update carries, by state-dict name: every one but those derived
        from another (a tied output head). The same set a checkpoint file holds."""
        derived = self._derived_keys()
        return {k: v for k, v in self.model.state_dict().items() if k not in derived}

    def swap_weights(
        self, state: dict[str, torch.Tensor], *, source: str
    ) -> dict[str, torch.Tensor]:
        """Make ``state``'s tensors the live ones (a subset of ``streamable()`` may be given):
        each becomes its parameter's or buffer's storage, without a copy when the dtype
        matches. Returns the tensors they replaced, for reuse as receive buffers.

        Raises WeightLoadError, changing nothing, when a name or a shape does not fit.
        """
        current = self.streamable()
        unexpected = sorted(set(state) - set(current))
        if unexpected:
            raise WeightLoadError(
                f"weights from {source} do not fit the served model "
                f"({type(self.model).__name__}): unexpected {unexpected[:5]}"
            )
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(current[name].shape):
                raise WeightLoadError(
                    f"weights from {source} do not fit the served model: {name} has shape "
                    f"{tuple(tensor.shape)}, the served model {tuple(current[name].shape)}"
                )
        targets = {name: self._live_tensor(name) for name in state}
        replaced: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in state.items():
                target = targets[name]
                replaced[name] = target.data
                target.data = tensor if tensor.dtype == target.dtype else tensor.to(target.dtype)
        return replaced

    def _live_tensor(self, name: str) -> torch.Tensor:
        # state_dict() returns detached aliases: swapping storage needs the module's own object
        try:
            return self.model.get_parameter(name)
        except AttributeError:
            return self.model.get_buffer(name)

    def _derived_keys(self) -> set[str]:
        # A tied output head has no tensor of its own in the checkpoint.
        if getattr(self.config.get_text_config(), "tie_word_embeddings", False):
            return {k for k in self.model.state_dict() if k.startswith("lm_head.")}
        return set()

    def _check_config(self, path: Path) -> None:
        config_file = path / "config.json"
        if not config_file.is_file():
            return
        theirs = json.loads(config_file.read_text())
        ours = self.config.to_dict()
        for key in ("architectures", "model_type"):
            if theirs.get(key) is not None and theirs.get(key) != ours.get(key):
                raise WeightLoadError(
                    f"{str(path)!r} holds a {theirs.get(key)} model, the engine serves "
                    f"{ours.get(key)}: start another engine for another architecture"
                )


@contextlib.contextmanager
def _quiet_progress_bars():
    # A server's stderr carries JSON log lines, not tqdm bars.
    from transformers.utils import logging as hf_logging

    were_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if were_on:
            hf_logging.enable_progress_bar()


@functools.cache
def in_place_layer() -> type:
    """``InPlaceLayer``: a subclass of transformers' ``DynamicLayer``, made on first use (this
    module is imported without transformers)."""
    from transformers.cache_utils import DynamicLayer

    class InPlaceLayer(DynamicLayer):
        """A decode step's cache layer over a buffer with room (``PaddedKV.make_room``):
        ``update`` writes the step's keys and values into the next columns and returns views
        of the buffer, where ``DynamicLayer`` concatenates (a copy of the whole layer a step,
        and one more to build the cache from the tensors)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
            super().__init__()
            self._buffers = (keys, values)
            self._width = width
            self.keys, self.values = keys[:, :, :width], values[:, :, :width]
            self.device, self.is_initialized = keys.device, True

        def update(
            self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
        ) -> tuple[torch.Tensor, torch.Tensor]:
            start = self._width
            end = self._width = start + key_states.shape[2]
            keys, values = self._buffers
            keys[:, :, start:end] = key_states
            values[:, :, start:end] = value_states
            self.keys, self.values = keys[:, :, :end], values[:, :, :end]
            return self.keys, self.values

    return InPlaceLayer


def _past_kv(prefixes: list[CachedPrefix | None], lengths: list[int]) -> PaddedKV:
    """The cached prefixes as one left-padded batch, each row's ``length`` tokens
    right-aligned."""
    width = max(lengths)
    sample = next(p for p in prefixes if p is not None)
    keys, values = [], []
    for layer, (k0, v0) in enumerate(zip(sample.keys, sample.values, strict=True)):
        h, _, d = k0.shape
        k = k0.new_zeros((len(lengths), h, width, d))  # (B, H_kv, P, D)
        v = v0.new_zeros((len(lengths), h, width, d))
        for row, (prefix, n) in enumerate(zip(prefixes, lengths, strict=True)):
            if prefix is not None and n:
                k[row, :, width - n :] = prefix.keys[layer][:, :n]
                v[row, :, width - n :] = prefix.values[layer][:, :n]
        keys.append(k)
        values.append(v)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)  # (B, P)
    for row, n in enumerate(lengths):
        if n:
            mask[row, width - n :] = 1
    return PaddedKV(keys=keys, values=values, mask=mask)


def _cache_tensors(cache) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    layers = getattr(cache, "layers", None)
    if layers is not None:  # transformers >= 4.56
        return [layer.keys for layer in layers], [layer.values for layer in layers]
    return list(cache.key_cache), list(cache.value_cache)


def _load_tokenizer(model_path: Path) -> Tokenizer:
    file = model_path / "tokenizer.json"
    if file.is_file():
        return Tokenizer.from_file(str(file))
    from transformers import AutoTokenizer

    backend = getattr(AutoTokenizer.from_pretrained(model_path), "backend_tokenizer", None)
    if backend is None:
        raise WeightLoadError(
            f"{str(model_path)!r} has no tokenizer.json and no fast tokenizer: save one with "
            "AutoTokenizer.from_pretrained(...).save_pretrained(dir)"
        )
    return backend


def _eos_token_ids(model_path: Path, text_config) -> frozenset[int]:
    ids: set[int] = set()
    for value in (getattr(text_config, "eos_token_id", None), _generation_eos(model_path)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return frozenset(ids)


def _generation_eos(model_path: Path):
    file = model_path / "generation_config.json"
    if not file.is_file():
        return None
    return json.loads(file.read_text()).get("eos_token_id")
