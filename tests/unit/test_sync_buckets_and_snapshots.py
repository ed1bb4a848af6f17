"""Bucketing of weight streams and disk snapshots (written once per version, atomic, pruned to K)."""

import asyncio
import json

import pytest
import torch
from safetensors.torch import load_file

from verst.sync.buckets import BucketStream, rebucket
from verst.sync.disk import SNAPSHOT_INFO, SnapshotWriter, list_snapshots, prune_snapshots, snapshot_path


def named(sizes):
    return [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]  # float32: 4 bytes each


def test_rebucket_keeps_order_and_bounds_bytes():
    tensors = named([10, 10, 30, 5, 5, 5])
    buckets = list(rebucket([tensors[:2], tensors[2:]], bucket_bytes=80))
    assert [[name for name, _ in b] for b in buckets] == [["t0", "t1"], ["t2"], ["t3", "t4", "t5"]]
    assert [len(b) for b in rebucket([named([50, 1])], bucket_bytes=4)] == [1, 1]  # a big tensor goes alone


def test_rebucket_refuses_a_name_twice_and_a_bad_bound():
    with pytest.raises(ValueError, match="'t0' appears twice"):
        list(rebucket([named([1]), named([1])], bucket_bytes=100))
    with pytest.raises(ValueError, match="bucket_bytes must be >= 1"):
        list(rebucket([], bucket_bytes=0))


def test_bucket_stream_reads_ahead_and_closes_its_source_on_an_early_stop():
    events = []

    def source():
        try:
            for i in range(5):
                events.append(f"read {i}")
                yield [(f"w{i}", torch.zeros(4))]
        finally:
            events.append("closed")

    async def main():
        stream = BucketStream(source(), bucket_bytes=16)
        got = []
        async for bucket in stream:
            got.append(bucket[0][0])
            if len(got) == 2:
                break
        await stream.aclose()
        return got

    assert asyncio.run(main()) == ["w0", "w1"]
    assert events[-1] == "closed" and "read 2" in events  # bucket 2 was read ahead while 1 was in use


def test_snapshot_is_a_complete_checkpoint_written_atomically(tmp_path):
    source = tmp_path / "model"
    source.mkdir()
    (source / "config.json").write_text("{}")
    (source / "tokenizer.json").write_text("{}")
    (source / "model.safetensors").write_bytes(b"old weights, never copied")
    writer = SnapshotWriter(tmp_path / "snaps", 3, source_model=source)
    writer.add(named([4, 4]))
    writer.add(named([0, 0, 8])[2:])
    assert list_snapshots(tmp_path / "snaps") == []  # nothing visible before commit
    path = writer.commit()
    assert path == snapshot_path(tmp_path / "snaps", 3) and list_snapshots(tmp_path / "snaps") == [(3, path)]
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"t0": "model-00001.safetensors", "t1": "model-00001.safetensors",
                                   "t2": "model-00002.safetensors"}
    assert index["metadata"]["total_size"] == 64
    assert torch.equal(load_file(path / "model-00002.safetensors")["t2"], torch.full((8,), 2.0))
    assert sorted(p.name for p in path.iterdir()) == [
        "config.json", "model-00001.safetensors", "model-00002.safetensors", "model.safetensors.index.json",
        "tokenizer.json", SNAPSHOT_INFO]
    assert json.loads((path / SNAPSHOT_INFO).read_text()) == {"weight_version": 3}


def test_single_bucket_snapshot_and_an_aborted_write(tmp_path):
    writer = SnapshotWriter(tmp_path, 1)
    writer.add(named([2]))
    assert (writer.commit() / "model.safetensors").exists()
    failed = SnapshotWriter(tmp_path, 2)
    failed.add(named([2]))
    failed.abort()
    assert [v for v, _ in list_snapshots(tmp_path)] == [1] and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(ValueError, match="v5 has no tensors"):
        SnapshotWriter(tmp_path, 5).commit()


def test_prune_keeps_the_newest(tmp_path):
    for version in (1, 2, 10, 11):
        writer = SnapshotWriter(tmp_path, version)
        writer.add(named([1]))
        writer.commit()
    removed = prune_snapshots(tmp_path, keep_last=2)
    assert [p.name for p in removed] == ["weights_v00000001", "weights_v00000002"]
    assert [v for v, _ in list_snapshots(tmp_path)] == [10, 11]
    with pytest.raises(ValueError, match="keep_last must be >= 1"):
        prune_snapshots(tmp_path, keep_last=0)
