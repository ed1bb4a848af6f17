"""The weight wire formats' own mechanics: a shared-memory slot rewritten in place and kept mapped by the
reader (no fresh file or mapping per push), what replaces or deletes it, and the reader's refusals."""

import json
import os

import pytest
import torch

from verst.inference_client.protocol import InvalidRequest
from verst.inference_client.weights import ShmReader, ShmSlot, write_shm_bucket


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
