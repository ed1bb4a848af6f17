"""The `disk` transport: each version is written once as a safetensors snapshot directory (loadable by
`transformers`, eval fleets and external engines; with LoRA adapter sync, a PEFT adapter directory), then
loaded by every engine; the last K are kept.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path

from verst.inference_client.fleet import EngineFleet
from verst.sync.buckets import BucketStream
from verst.sync.transport import AdapterSpec, PushStats, TransportOptions
from verst.types import WeightBucket

SNAPSHOT_PREFIX = "weights_v"
SNAPSHOT_INFO = "verst_snapshot.json"
INDEX_FILE = "model.safetensors.index.json"
ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # PEFT's file names
_SNAPSHOT_RE = re.compile(rf"^{SNAPSHOT_PREFIX}(\d+)$")
# Weight files of the source checkpoint are replaced by the snapshot's; everything else (config,
# tokenizer, chat template, generation config) is copied so the snapshot loads on its own.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")


def snapshot_path(root: str | Path, version: int) -> Path:
    return Path(root) / f"{SNAPSHOT_PREFIX}{version:08d}"


def list_snapshots(root: str | Path) -> list[tuple[int, Path]]:
    """Complete snapshots under `root`, oldest version first (partial writes are hidden dot-dirs)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _SNAPSHOT_RE.match(path.name)
        if match and path.is_dir():
            found.append((int(match.group(1)), path))
    return sorted(found)


def prune_snapshots(root: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` snapshots; returns what was deleted."""
    if keep_last < 1:
        raise ValueError(f"keep_last must be >= 1 (the snapshot the engines just loaded), got {keep_last}")
    old = [path for _, path in list_snapshots(root)[:-keep_last]]
    for path in old:
        shutil.rmtree(path)
    return old


class SnapshotWriter:
    """Writes one version: `add(bucket)` per bucket (one shard each), then `commit()`, which moves the
    finished directory into place in one rename, so a reader never sees half a snapshot. With
    `adapter_config`, the snapshot is a PEFT adapter directory: that config and the one shard's tensors."""

    def __init__(self, root: str | Path, version: int, source_model: str | Path | None = None,
                 adapter_config: dict | None = None):
        self.root, self.version, self.adapter_config = Path(root), version, adapter_config
        self.source_model = Path(source_model) if source_model is not None else None
        self.root.mkdir(parents=True, exist_ok=True)
        self.partial = self.root / f".{SNAPSHOT_PREFIX}{version:08d}.partial-{uuid.uuid4().hex[:8]}"
        self.partial.mkdir()
        self.shards: list[tuple[str, list[str]]] = []
        self.total_bytes = 0

    def add(self, bucket: WeightBucket) -> None:
        from safetensors.torch import save_file

        name = f"model-{len(self.shards) + 1:05d}.safetensors"
        tensors = {key: tensor.detach().to("cpu").contiguous() for key, tensor in bucket}
        save_file(tensors, str(self.partial / name), metadata={"format": "pt"})
        self.shards.append((name, list(tensors)))
        self.total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())

    def commit(self) -> Path:
        if not self.shards:
            raise ValueError(f"weight snapshot v{self.version} has no tensors (the push was empty)")
        if self.adapter_config is not None:
            if len(self.shards) != 1:
                raise ValueError(f"adapter snapshot v{self.version} must be one file, got {len(self.shards)} shards")
            (self.partial / self.shards[0][0]).rename(self.partial / ADAPTER_WEIGHTS)
            (self.partial / ADAPTER_CONFIG).write_text(json.dumps(self.adapter_config, indent=2, sort_keys=True))
        elif len(self.shards) == 1:
            (self.partial / self.shards[0][0]).rename(self.partial / "model.safetensors")
        else:
            weight_map = {key: shard for shard, keys in self.shards for key in keys}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.partial / INDEX_FILE).write_text(json.dumps(index, indent=1))
        if self.source_model is not None and self.adapter_config is None:
            self._copy_model_files()
        (self.partial / SNAPSHOT_INFO).write_text(json.dumps({"weight_version": self.version}))
        final = snapshot_path(self.root, self.version)
        if final.exists():
            # Only a failed earlier push of this version leaves one (the syncer never reuses a version
            # that reached the engines); its contents may not match this push.
            shutil.rmtree(final)
        self.partial.rename(final)
        return final

    def abort(self) -> None:
        shutil.rmtree(self.partial, ignore_errors=True)

    def _copy_model_files(self) -> None:
        assert self.source_model is not None
        if not self.source_model.is_dir():
            raise FileNotFoundError(f"disk transport source_model {self.source_model} is not a directory")
        for path in self.source_model.iterdir():
            if path.is_file() and not path.name.endswith(_WEIGHT_SUFFIXES):
                shutil.copy2(path, self.partial / path.name)


class DiskTransport:
    """Snapshot under `directory/weights_vNNNNNNNN/`, then `/update_weights_from_disk` on every engine
    (which must see the same filesystem). `source_model` (the HF checkpoint trained from) supplies config
    and tokenizer files, making each snapshot a complete checkpoint. Keeps the newest `keep_last` (older
    ones are deleted in the background after a push; the next push and `close()` wait for that). With
    `adapter`, each snapshot is a PEFT adapter directory, which every engine loads under the adapter's name
    (`/load_lora_adapter`; `EngineFleet.replace_lora_adapter`).
    """

    snapshot_of = staticmethod(snapshot_path)  # where the push of a version leaves its snapshot
    versioned_loads = False  # a snapshot's version is set once every engine loaded it

    def __init__(self, fleet: EngineFleet, directory: str | Path, *, bucket_bytes: int, keep_last: int = 2,
                 source_model: str | Path | None = None, adapter: AdapterSpec | None = None):
        if keep_last < 1:
            raise ValueError(f"disk transport keep_last must be >= 1, got {keep_last}")
        self.fleet, self.directory, self.bucket_bytes = fleet, Path(directory), bucket_bytes
        self.keep_last, self.source_model, self.adapter = keep_last, source_model, adapter
        self.last_snapshot: Path | None = None
        self._pruning: asyncio.Future | None = None

    @classmethod
    def build(cls, fleet: EngineFleet, options: TransportOptions) -> DiskTransport:
        if options.snapshot_dir is None:
            raise ValueError("sync.transport = 'disk' needs snapshot_dir (where weight snapshots are written)")
        return cls(fleet, options.snapshot_dir, bucket_bytes=options.bucket_bytes, keep_last=options.keep_snapshots,
                   source_model=options.source_model, adapter=options.adapter)

    def use_adapter(self, adapter: AdapterSpec | None) -> None:
        self.adapter = adapter

    async def push(self, buckets: Iterable[WeightBucket], version: int) -> dict[str, float]:
        await self._pruned()
        adapter = self.adapter
        # an adapter is one file, as PEFT writes it
        stats, stream = PushStats(), BucketStream(buckets, sys.maxsize if adapter else self.bucket_bytes)
        writer = await asyncio.to_thread(SnapshotWriter, self.directory, version, self.source_model,
                                         adapter.config if adapter else None)
        try:
            async for bucket in stream:
                await asyncio.to_thread(writer.add, bucket)
                stats.add(bucket)
            path = await asyncio.to_thread(writer.commit)
        except BaseException:
            await asyncio.to_thread(writer.abort)
            raise
        finally:
            await stream.aclose()
        self.last_snapshot = path
        if adapter is not None:
            await self.fleet.replace_lora_adapter(adapter.name, str(path))
        else:
            await self.fleet.update_weights_from_disk(str(path), None)  # type: ignore[arg-type]
        # Deleting a snapshot's files takes about as long as a tenth of writing them: done while the engines
        # generate again, and waited for by the next push or `close()`.
        self._pruning = asyncio.ensure_future(asyncio.to_thread(prune_snapshots, self.directory, self.keep_last))
        return stats.metrics()

    async def _pruned(self) -> None:
        pruning, self._pruning = self._pruning, None
        if pruning is not None:
            await pruning

    async def close(self) -> None:
        await self._pruned()
