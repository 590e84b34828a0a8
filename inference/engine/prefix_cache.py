"""PrefixCache: finished sequences' KV, kept so that a later prompt starting with one of them
is not computed again (SGLang's prefix cache, reported as ``meta_info.cached_tokens``).

A multi-turn rollout's next prompt is its previous prompt, the reply it sampled and the new
messages (consumers/tracing/prompt_chain.py), so the previous turn's KV covers all of it but the new
messages; a GRPO group's samples share their prompt. An entry is one sequence: its token ids
and each layer's keys and values for them (every token but the last sampled one, whose KV was
never computed). A lookup takes the entry sharing the longest prefix with the prompt, at most
all of the prompt but its last token (whose logits the prefill must produce).

Memory is bounded in tokens (``max_tokens``; 0 keeps nothing): least recently used entries
leave first, and an entry that a new one extends leaves at once (the new one holds it). A
weight change empties the cache and starts a new ``epoch``: KV computed before it, by rows
still running, is never stored after it. One lock guards it (lookups and stores run on the
scheduler's worker thread, a flush on the event loop).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class CachedPrefix:
    """``length`` tokens of a cached sequence, to stand for a prompt's first ``length``."""

    keys: list[torch.Tensor]  # per layer (H_kv, L, D), L >= length
    values: list[torch.Tensor]  # per layer (H_kv, L, D)
    length: int


@dataclass
class _Entry:
    ids: np.ndarray  # (L,) int64
    keys: list[torch.Tensor]  # per layer (H_kv, L, D)
    values: list[torch.Tensor]


class PrefixCache:
    """Sequences' KV by token ids, at most ``max_tokens`` tokens of it."""

    def __init__(self, max_tokens: int) -> None:
        if max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self.epoch = 0
        self.tokens = 0  # held now
        self.hit_tokens = 0  # prompt tokens served from the cache, since start
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # oldest use first
        self._next_key = 0
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return (
            f"<PrefixCache entries={len(self._entries)} tokens={self.tokens}/{self.max_tokens} "
            f"hit_tokens={self.hit_tokens} epoch={self.epoch}>"
        )

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int]) -> CachedPrefix | None:
        """The cached KV of the longest prefix of ``ids`` held (never all of ``ids``)."""
        if not self._entries or len(ids) < 2:
            return None
        prompt = np.asarray(ids, dtype=np.int64)
        with self._lock:
            best, best_len = None, 0
            for key, entry in self._entries.items():
                n = min(len(entry.ids), len(prompt) - 1)
                if n <= best_len or entry.ids[0] != prompt[0]:
                    continue
                common = _common_prefix(entry.ids[:n], prompt[:n])
                if common > best_len:
                    best, best_len = key, common
            if best is None:
                return None
            self._entries.move_to_end(best)
            entry = self._entries[best]
            self.hit_tokens += best_len
            return CachedPrefix(entry.keys, entry.values, best_len)

    def store(
        self, ids: list[int], keys: list[torch.Tensor], values: list[torch.Tensor], epoch: int
    ) -> bool:
        """Keep ``keys``/``values`` (per layer (H_kv, len(ids), D), not shared with anything
        that changes them) for ``ids``, unless computed before the last flush (``epoch``) or
        larger than the whole budget. Returns whether it was stored."""
        if len(ids) > self.max_tokens or len(ids) < 2:
            return False
        new = np.asarray(ids, dtype=np.int64)
        with self._lock:
            if epoch != self.epoch:
                return False
            for key, entry in list(self._entries.items()):
                n = len(entry.ids)
                if n <= len(new) and _common_prefix(entry.ids, new[:n]) == n:
                    self._drop(key)  # the new entry holds all of it
                elif n > len(new) and _common_prefix(entry.ids[: len(new)], new) == len(new):
                    self._entries.move_to_end(key)  # already held, within a longer one
                    return False
            self._entries[self._next_key] = _Entry(new, keys, values)
            self._next_key += 1
            self.tokens += len(new)
            while self.tokens > self.max_tokens:
                self._drop(next(iter(self._entries)))
            return True

    def flush(self) -> None:
        """Forget everything, and refuse KV computed before now (a weight change)."""
        with self._lock:
            self._entries.clear()
            self.tokens = 0
            self.epoch += 1

    def _drop(self, key: int) -> None:
        self.tokens -= len(self._entries.pop(key).ids)


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two equally long arrays."""
    differ = np.flatnonzero(a != b)
    return int(differ[0]) if differ.size else int(a.size)
