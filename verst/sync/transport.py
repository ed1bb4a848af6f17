"""The WeightTransport contract (DESIGN.md): push bucketed, HF-named full tensors (or a LoRA adapter's,
`AdapterSpec`) to every engine of a fleet, and close. Pausing and checks belong to `WeightSyncer`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from verst.config.registries import WEIGHT_TRANSPORTS
from verst.types import WeightBucket


@dataclasses.dataclass(frozen=True)
class TransportOptions:
    """What a transport may be built with (each takes what it uses): `device` is where the trainer's full
    weights live ("cuda": NCCL, CUDA IPC); `snapshot_dir`, `keep_snapshots`, `source_model` are the disk
    snapshots' (`source_model` supplies config and tokenizer files); `master_address` must reach the engines
    (a process-group broadcast); `adapter`: every push is that LoRA adapter, served under its name."""

    bucket_bytes: int
    device: str = "cpu"
    snapshot_dir: str | Path | None = None
    keep_snapshots: int = 2
    source_model: str | Path | None = None
    master_address: str = "127.0.0.1"
    timeout_s: float = 60.0
    adapter: AdapterSpec | None = None


@runtime_checkable
class WeightTransport(Protocol):
    """Moves weights to every engine; never pauses engines (the syncer does).

    `push` may be handed buckets of any size: it regroups them to its own `bucket_bytes`. A push that
    raises may have left engines with some tensors of the new weights and the rest of the old ones.

    A transport whose `versioned_loads` is true flushes the engines' caches with every load (the update
    requests' `flush_cache`) and sets `version` with its last one (`weight_version`, as SGLang's update
    routes take it): the syncer then sends no flush and no version update of its own, two round trips
    per engine fewer. Without it (or when false) the syncer flushes before the push and sets the version
    after it.
    """

    @property
    def versioned_loads(self) -> bool:
        """Whether its loads flush the cache and the last one sets the version (see above)."""
        ...

    async def push(self, buckets: Iterable[WeightBucket], version: int) -> dict[str, float]:
        """Send every tensor to every engine; returns `sync/bytes`, `sync/buckets`, `sync/tensors`,
        `sync/push_seconds` (bytes are counted once, however many engines receive them)."""
        ...

    def use_adapter(self, adapter: AdapterSpec | None) -> None:
        """LoRA's adapter sync: the next pushes are `adapter`'s tensors, served under its name (multi-LoRA
        changes it between pushes); None: full weights."""
        ...

    async def close(self) -> None:
        """Release what the transport holds (process group, files); safe to call twice. A later push
        sets up what it needs again."""
        ...


@dataclasses.dataclass(frozen=True)
class AdapterSpec:
    """A LoRA run's adapter sync: every push is the whole adapter (A and B of each targeted layer, under
    PEFT's names), which the engines serve under `name`; `config` is its adapter_config.json (rank, alpha,
    target modules). It travels as one bucket: the engines build the adapter from all of its tensors."""

    name: str
    config: dict[str, Any]


def _full_weights(transport: Any) -> bool:
    """Full weights: each load flushes the cache and the last sets the version (`WeightTransport`); an
    adapter's load leaves the base model's cache alone, so the syncer flushes for it."""
    return transport.adapter is None


# `versioned_loads` of a transport whose loads carry SGLang's `flush_cache` and `weight_version` fields
VERSIONED_UNLESS_ADAPTER = property(_full_weights)


@dataclasses.dataclass
class PushStats:
    """Counts of one push, reported as `sync/` metrics."""

    bytes: int = 0
    buckets: int = 0
    tensors: int = 0
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def add(self, bucket: WeightBucket) -> None:
        self.buckets += 1
        self.tensors += len(bucket)
        self.bytes += sum(t.numel() * t.element_size() for _, t in bucket)

    def metrics(self) -> dict[str, float]:
        return {
            "sync/bytes": float(self.bytes),
            "sync/buckets": float(self.buckets),
            "sync/tensors": float(self.tensors),
            "sync/push_seconds": time.perf_counter() - self.started,
        }


def pushed_snapshot(transport: str, root: str | Path, version: int) -> Path | None:
    """Where the push of `version` left its Hugging Face snapshot under `root` (a full model, or with LoRA's
    adapter sync the adapter), for a transport that keeps them (`keeps_snapshots`: its class's
    `snapshot_of`); None for one that keeps none. The newest `keep_last` of them are on disk."""
    if not WEIGHT_TRANSPORTS.entry(transport).keeps_snapshots:
        return None
    return WEIGHT_TRANSPORTS.load(transport).snapshot_of(root, version)
