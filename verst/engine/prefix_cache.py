"""Prefix cache: KV of recently seen token sequences, so a prompt that extends one skips recomputing it.

Sequences are indexed by chained hashes of their 16-token blocks; a lookup takes the longest indexed
block prefix, then extends the match token by token. Least recently used sequences are evicted once the
cache holds more than its token budget. A sequence that extends a cached one replaces it. KV computed
under a LoRA adapter lives in that adapter's namespace, apart from the base's and every other adapter's.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import numpy as np
import torch

BLOCK = 16


@dataclasses.dataclass(eq=False)
class CachedSequence:
    tokens: list[int]
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per layer ([kv_heads, len, head_dim],) * 2
    experts: np.ndarray | None  # [len, moe_layers, top_k] or None
    last_used: int = 0
    keys: list[int] = dataclasses.field(default_factory=list)  # its block-hash index entries
    namespace: str | None = None  # the LoRA adapter (name@version) the KV was computed under; None: base


def block_hashes(tokens: list[int], namespace: str | None = None) -> list[int]:
    """h[k] identifies tokens[: (k + 1) * BLOCK] in `namespace`; chained so each costs one block."""
    out, h = [], 0 if namespace is None else hash(namespace)
    for start in range(0, len(tokens) - BLOCK + 1, BLOCK):
        h = hash((h, tuple(tokens[start : start + BLOCK])))
        out.append(h)
    return out


class PrefixCache:
    """Token-budgeted LRU of sequences and their KV; `max_tokens = 0` disables it."""

    def __init__(self, max_tokens: int):
        if max_tokens < 0:
            raise ValueError(f"prefix cache max_tokens must be >= 0, got {max_tokens}")
        self.max_tokens = max_tokens
        self._index: dict[int, CachedSequence] = {}
        self._entries: set[CachedSequence] = set()
        self._clock = itertools.count(1)
        self.num_tokens = 0
        self.hits = 0
        self.lookups = 0

    def match(self, tokens: list[int], namespace: str | None = None) -> tuple[CachedSequence | None, int]:
        """The cached sequence of `namespace` sharing the longest prefix with `tokens`, and its length."""
        self.lookups += 1
        if not self._entries:
            return None, 0
        hashes = block_hashes(tokens, namespace)
        for k in range(len(hashes) - 1, -1, -1):
            entry = self._index.get(hashes[k])
            if entry is None:
                continue
            n = (k + 1) * BLOCK
            if entry.namespace != namespace or entry.tokens[:n] != tokens[:n]:  # a hash collision; not worth chasing
                return None, 0
            limit = min(len(entry.tokens), len(tokens))
            while n < limit and entry.tokens[n] == tokens[n]:
                n += 1
            entry.last_used = next(self._clock)
            self.hits += 1
            return entry, n
        return None, 0

    def insert(
        self,
        tokens: list[int],
        read_kv: Callable[[], list[tuple[torch.Tensor, torch.Tensor]]],
        experts: np.ndarray | None,
        namespace: str | None = None,
    ) -> None:
        """Remember `tokens` in `namespace`; `read_kv()` copies their KV out, called only when the cache
        takes them."""
        if self.max_tokens == 0 or len(tokens) < BLOCK or len(tokens) > self.max_tokens:
            return
        found, n = self.match(tokens, namespace)
        self.lookups -= 1
        if found is not None and n == len(tokens):
            return  # already cached inside a longer (or equal) sequence
        if found is not None and n == len(found.tokens):
            self._remove(found)  # the new sequence extends it
        entry = CachedSequence(list(tokens), read_kv(), experts, last_used=next(self._clock), namespace=namespace)
        entry.keys = block_hashes(entry.tokens, namespace)
        for h in entry.keys:
            self._index[h] = entry
        self._entries.add(entry)
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            self._remove(min(self._entries, key=lambda e: e.last_used))

    def flush(self) -> None:
        self._index.clear()
        self._entries.clear()
        self.num_tokens = 0

    def drop(self, namespace: str) -> None:
        """Forget every sequence of `namespace` (an adapter unloaded or replaced)."""
        for entry in [e for e in self._entries if e.namespace == namespace]:
            self._remove(entry)

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        """Bytes of the cached KV."""
        return sum(t.numel() * t.element_size() for e in self._entries for pair in e.kv for t in pair)

    def _remove(self, entry: CachedSequence) -> None:
        for h in entry.keys:
            if self._index.get(h) is entry:
                del self._index[h]
        self._entries.discard(entry)
        self.num_tokens -= len(entry.tokens)
