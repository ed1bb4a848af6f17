"""Slot KV storage for continuous batching: one row ("slot") per running request, grown on demand.

`update()` writes each row's new keys and values at that row's own positions and returns the full-width
K/V of the step's rows; the caller's 4-D mask hides positions a row has not filled. Each layer stores
`[slots, kv_heads, capacity, head_dim]`; the last column of `capacity` is a scratch column that padding
tokens write into. The native forward calls `update()` itself; for transformers' forward,
`transformers_slot_cache` makes the same storage a transformers `Cache` (imported only then).
"""

from __future__ import annotations

import functools

import torch

_MIN_SLOTS = 8
_LENGTH_QUANTUM = 128


class SlotKVCache:
    """KV of all running requests. `plan()` says which slots a forward covers and where tokens go."""

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self._need_slots = _MIN_SLOTS
        self._need_length = _LENGTH_QUANTUM
        self._rows = (0, 0)
        self._slot_index: torch.Tensor | None = None  # [batch, seq]
        self._write_pos: torch.Tensor | None = None  # [batch, seq]
        self._width = 0

    # ---- planning a forward ---------------------------------------------------------------------
    def reserve(self, slots: int, length: int) -> None:
        """Room for `slots` rows of `length` positions (plus the scratch column) before the next forward."""
        self._need_slots = max(self._need_slots, slots)
        self._need_length = max(self._need_length, length)

    def plan(self, first_slot: int, write_pos: torch.Tensor, width: int) -> None:
        """The next forward covers slots `first_slot ...` (one per row of `write_pos` [batch, seq]).

        Token (b, t) is written at position `write_pos[b, t]`; -1 sends it to the scratch column.
        Attention sees positions `[0, width)` of each row.
        """
        batch = write_pos.shape[0]
        self.reserve(first_slot + batch, width)
        self._rows = (first_slot, first_slot + batch)
        self._slot_index = torch.arange(first_slot, first_slot + batch)[:, None].expand_as(write_pos)
        self._write_pos = write_pos
        self._width = width

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """Write the step's K/V ([batch, kv_heads, seq, head_dim]) and return the rows' K/V up to width."""
        keys, values = self._storage(layer_idx, key_states, value_states)
        pos = torch.where(self._write_pos < 0, keys.shape[2] - 1, self._write_pos).to(keys.device)
        slots = self._slot_index.to(keys.device)
        keys[slots, :, pos] = key_states.transpose(1, 2)
        values[slots, :, pos] = value_states.transpose(1, 2)
        first, last = self._rows
        return keys[first:last, :, : self._width], values[first:last, :, : self._width]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self._width

    # ---- row management ----------------------------------------------------------------------------
    def copy_rows(self, sources: list[int], targets: list[int], length: int) -> None:
        """Copy the first `length` positions of each source slot into its target slot (one indexed copy per
        layer and tensor; no slot may be both), growing the storage if needed: the KV a follower shares with
        its leader, or rows moved down into freed slots (compaction). Positions past a source's own KV come
        along as junk the target's mask hides and its next writes replace."""
        if not sources or not length:
            return
        self.reserve(max(targets) + 1, length)
        src, dst = torch.tensor(sources), torch.tensor(targets)
        for layer_idx in range(len(self.keys)):
            keys, values = self.keys[layer_idx], self.values[layer_idx]
            if keys is None or values is None:
                raise RuntimeError("copy_rows before any forward filled the KV storage")
            keys, values = self._storage(layer_idx, keys, values)
            keys[dst, :, :length] = keys[src, :, :length]
            values[dst, :, :length] = values[src, :, :length]

    def read_row(self, slot: int, length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of the first `length` positions of a slot, per layer: ([kv_heads, length, head_dim],) * 2."""
        out = []
        for k, v in zip(self.keys, self.values):
            if k is None or v is None:
                raise RuntimeError("read_row before any forward filled the KV storage")
            out.append((k[slot, :, :length].clone(), v[slot, :, :length].clone()))
        return out

    def write_row(self, slot: int, kv: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> None:
        """Put the first `length` positions of cached per-layer K/V into a slot."""
        if len(kv) != len(self.keys):
            raise ValueError(f"write_row: {len(kv)} cached layers but the model has {len(self.keys)}")
        self.reserve(slot + 1, length)
        for layer_idx, (k, v) in enumerate(kv):
            keys, values = self._storage(layer_idx, k[None], v[None])
            keys[slot, :, :length] = k[:, :length]
            values[slot, :, :length] = v[:, :length]

    def clear(self) -> None:
        """Drop all storage (no running requests may hold slots)."""
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self._need_slots, self._need_length = _MIN_SLOTS, _LENGTH_QUANTUM

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.keys, *self.values) if t is not None)

    # ---- storage ------------------------------------------------------------------------------------
    def _storage(self, layer_idx: int, k_like: torch.Tensor, v_like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's storage, (re)allocated when too small; the likes are [batch, kv_heads, seq, dim]."""
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        slots_needed, length_needed = self._need_slots, self._need_length + 1  # + scratch column
        if keys is not None and values is not None and keys.shape[0] >= slots_needed and keys.shape[2] >= length_needed:
            return keys, values
        old_slots, old_len = (keys.shape[0], keys.shape[2]) if keys is not None else (0, 0)
        slots = max(slots_needed, old_slots, _MIN_SLOTS)
        if old_slots and slots > old_slots:
            slots = max(slots, old_slots * 2)
        length = max(length_needed, old_len)
        if length > old_len:
            length = max(length, old_len + old_len // 2)
            length = -(-(length - 1) // _LENGTH_QUANTUM) * _LENGTH_QUANTUM + 1
        new_k = k_like.new_zeros(slots, k_like.shape[1], length, k_like.shape[3])
        new_v = v_like.new_zeros(slots, v_like.shape[1], length, v_like.shape[3])
        if keys is not None and values is not None:
            # the old scratch column is not copied: it holds nothing anyone reads
            new_k[:old_slots, :, : old_len - 1] = keys[:, :, : old_len - 1]
            new_v[:old_slots, :, : old_len - 1] = values[:, :, : old_len - 1]
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v
        return new_k, new_v


def transformers_slot_cache(num_layers: int) -> SlotKVCache:
    """A `SlotKVCache` that transformers' attention layers take as their cache (`past_key_values`)."""
    return _transformers_cache_class()(num_layers)


@functools.cache
def _transformers_cache_class() -> type:
    from transformers.cache_utils import Cache, CacheLayerMixin

    class SlotLayer(CacheLayerMixin):
        """Placeholder so `Cache`'s per-layer properties work; the storage lives in `SlotKVCache`."""

        is_sliding = False

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass

        def update(self, key_states, value_states, *args, **kwargs):
            raise RuntimeError("SlotKVCache layers are updated through SlotKVCache.update")

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            raise RuntimeError("SlotKVCache is used with a prepared 4-D mask only")

        def get_seq_length(self) -> int:
            return 0

        def get_max_length(self) -> int:
            return -1

    class TransformersSlotKVCache(SlotKVCache, Cache):
        def __init__(self, num_layers: int):
            Cache.__init__(self, layers=[SlotLayer() for _ in range(num_layers)])
            SlotKVCache.__init__(self, num_layers)

    return TransformersSlotKVCache
