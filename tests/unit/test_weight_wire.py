"""The weight wire formats' own mechanics: a shared-memory slot rewritten in place and kept mapped by the
reader (no fresh file or mapping per push), what replaces or deletes it, the reader's refusals; a
flattened bucket's kept buffer, its layout, and buckets of one dtype."""

import json
import os

import pytest
import torch

from verst.inference_client.protocol import InvalidRequest
from verst.inference_client.weights import FlatBuffer, ShmReader, ShmSlot, flat_views, one_dtype, write_shm_bucket
from verst.sync.buckets import rebucket


def named(seed, sizes=(3, 5)):
    g = torch.Generator().manual_seed(seed)
    return [(f"t{i}", torch.randn(n, 2, generator=g)) for i, n in enumerate(sizes)]


def test_a_slot_is_rewritten_in_place_and_the_reader_keeps_its_mapping():
    slot, reader = ShmSlot(), ShmReader()
    try:
        first = reader.read(slot.write(named(0)))
        path = slot.path
        second = reader.read(slot.write(named(1)))
        assert slot.path == path and os.path.exists(path)
        # the same mapping: views of the first read now show the second write
        assert first[0][1].data_ptr() == second[0][1].data_ptr()
        for (name, got), (want_name, want) in zip(second, named(1)):
            assert name == want_name and torch.equal(got, want)
        # a bigger bucket replaces the file; the reader maps the new one and drops the deleted one
        bigger = named(2, sizes=(300, 5))
        got = reader.read(slot.write(bigger))
        assert slot.path != path and not os.path.exists(path)
        assert torch.equal(got[0][1], bigger[0][1]) and list(reader._mapped) == [slot.path]
        path = slot.path
    finally:
        slot.close()
    assert slot.path is None and not os.path.exists(path)


def test_a_one_off_bucket_deletes_its_file_and_the_reader_refuses_bad_manifests():
    with write_shm_bucket(named(3)) as bucket:
        path = bucket.path
        spec = json.loads(bucket.manifest)
        assert [t["offset"] % 64 for t in spec["tensors"]] == [0, 0]
        spec["tensors"][1]["offset"] = 10**9
        with pytest.raises(InvalidRequest, match="outside the"):
            ShmReader().read(json.dumps(spec))
    assert not os.path.exists(path)
    with pytest.raises(InvalidRequest, match="no such shared-memory file"):
        ShmReader().read(bucket.manifest)
    with pytest.raises(InvalidRequest, match="must be a file under /dev/shm"):
        ShmReader().read(json.dumps({"path": "/etc/passwd", "tensors": []}))


def test_a_flat_buffer_is_kept_until_a_bucket_needs_more():
    buffer = FlatBuffer()
    first = buffer.take(torch.float32, 100)
    smaller = buffer.take(torch.bfloat16, 50)
    assert smaller.data_ptr() == first.data_ptr() and smaller.dtype == torch.bfloat16 and smaller.numel() == 50
    bigger = buffer.take(torch.float32, 1000)
    assert bigger.numel() == 1000
    tensors = [t for _, t in named(4)]
    flat = buffer.take(torch.float32, sum(t.numel() for t in tensors))
    for view, tensor in zip(flat_views(flat, [list(t.shape) for t in tensors]), tensors):
        view.copy_(tensor)
    assert torch.equal(flat, torch.cat([t.flatten() for t in tensors]))  # SGLang's flattened_bucket layout
    assert one_dtype(["float32", "float32"]) == torch.float32 and one_dtype(["float32", "bfloat16"]) is None


def test_rebucket_by_dtype_ends_a_bucket_where_the_dtype_changes():
    tensors = [("a", torch.zeros(2)), ("b", torch.zeros(2)), ("c", torch.zeros(2, dtype=torch.bfloat16)),
               ("d", torch.zeros(2))]
    grouped = [[name for name, _ in bucket] for bucket in rebucket([tensors], 1 << 20, by_dtype=True)]
    assert grouped == [["a", "b"], ["c"], ["d"]]
    assert [[name for name, _ in bucket] for bucket in rebucket([tensors], 1 << 20)] == [["a", "b", "c", "d"]]
