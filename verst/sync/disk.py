"""The `disk` transport: each version is written once as a safetensors snapshot directory (loadable by
`transformers`, eval fleets and external engines), then loaded by every engine; the last K are kept.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import uuid
from collections.abc import Iterable
from pathlib import Path

from verst.inference_client.fleet import EngineFleet
from verst.sync.buckets import BucketStream
from verst.sync.transport import PushStats
from verst.types import WeightBucket

SNAPSHOT_PREFIX = "weights_v"
SNAPSHOT_INFO = "verst_snapshot.json"
INDEX_FILE = "model.safetensors.index.json"
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
    finished directory into place in one rename, so a reader never sees half a snapshot."""

    def __init__(self, root: str | Path, version: int, source_model: str | Path | None = None):
        self.root, self.version = Path(root), version
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
        if len(self.shards) == 1:
            (self.partial / self.shards[0][0]).rename(self.partial / "model.safetensors")
        else:
            weight_map = {key: shard for shard, keys in self.shards for key in keys}
            index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
            (self.partial / INDEX_FILE).write_text(json.dumps(index, indent=1))
        if self.source_model is not None:
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
    and tokenizer files, making each snapshot a complete checkpoint. Keeps the newest `keep_last`.
    """

    name = "disk"

    def __init__(self, fleet: EngineFleet, directory: str | Path, *, bucket_bytes: int, keep_last: int = 2,
                 source_model: str | Path | None = None):
        if keep_last < 1:
            raise ValueError(f"disk transport keep_last must be >= 1, got {keep_last}")
        self.fleet, self.directory, self.bucket_bytes = fleet, Path(directory), bucket_bytes
        self.keep_last, self.source_model = keep_last, source_model
        self.last_snapshot: Path | None = None

    async def push(self, buckets: Iterable[WeightBucket], version: int) -> dict[str, float]:
        stats, stream = PushStats(), BucketStream(buckets, self.bucket_bytes)
        writer = await asyncio.to_thread(SnapshotWriter, self.directory, version, self.source_model)
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
        await self.fleet.update_weights_from_disk(str(path), None)  # type: ignore[arg-type]
        await asyncio.to_thread(prune_snapshots, self.directory, self.keep_last)
        return stats.metrics()

    async def close(self) -> None:
        return None
