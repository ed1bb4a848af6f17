"""SGLang's tensor wire format (`tensor_payload`): a round trip keeps every dtype and shape bit for bit, the
staging buffer is reused without new files, shared-memory files go once both ends drop them, and the
receiver refuses anything but torch's tensor rebuilds, naming the field."""

import base64
import glob
import io
import os
import pickle

import pytest
import torch
from torch.multiprocessing import reductions

from verst.inference_client.protocol import InvalidRequest
from verst.inference_client.tensor_payload import (
    SharedStaging,
    _reduce_tensor,
    deserialize_named_tensors,
    serialize_named_tensors,
)


def torch_files() -> set[str]:
    return set(glob.glob("/dev/shm/torch_*"))


def named_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [("w", torch.randn(5, 3, generator=g)), ("ids", torch.arange(7)), ("half", torch.randn(4, generator=g).bfloat16()),
            ("empty", torch.empty(0, 2)), ("flag", torch.tensor([True, False]))]


def assert_bitwise_equal(got, want) -> None:
    assert [name for name, _ in got] == [name for name, _ in want]
    for (name, a), (_, b) in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert a.contiguous().view(torch.uint8).tolist() == b.contiguous().view(torch.uint8).tolist(), name


def test_staged_tensors_round_trip_bit_for_bit_and_their_file_goes_with_both_ends():
    before, want = torch_files(), named_tensors()
    staging = SharedStaging()
    staged = staging.stage(want)
    got = deserialize_named_tensors(serialize_named_tensors(staged))
    assert_bitwise_equal(got, want)
    # the receiver's tensors are views of the sender's file, not copies
    assert got[0][1].untyped_storage().is_shared() and len(torch_files() - before) == 1
    del got, staged
    staging.close()
    assert torch_files() == before


def test_the_staging_buffer_is_kept_across_pushes_and_grows_into_a_new_file():
    before, staging = torch_files(), SharedStaging()
    first = staging.stage([("a", torch.ones(100))])[0][1]
    second = staging.stage([("a", torch.full((50,), 2.0))])[0][1]
    assert second.data_ptr() == first.data_ptr() and len(torch_files() - before) == 1
    bigger = staging.stage([("a", torch.zeros(10_000))])[0][1]
    assert bigger.data_ptr() != first.data_ptr()
    del first, second, bigger
    staging.close()
    assert torch_files() == before


def test_each_entry_is_a_pickle_of_its_own_so_every_receiver_gives_back_its_reference():
    # two engines: each unpickles its own entry; the file goes once all three ends drop the storage
    before, staging = torch_files(), SharedStaging()
    staged = staging.stage([("a", torch.arange(6.0))])
    entries = [serialize_named_tensors(staged) for _ in range(2)]
    one, two = (deserialize_named_tensors(entry) for entry in entries)
    assert torch.equal(one[0][1], two[0][1])
    del one, two, staged
    staging.close()
    assert torch_files() == before


def test_a_cpu_tensor_keeps_torchs_own_rebuild_and_its_device():
    rebuild, args = _reduce_tensor(torch.zeros(2))
    assert rebuild is reductions.rebuild_tensor and args[0] is torch.Tensor


@pytest.mark.parametrize("payload, message", [
    ("not base64!", "not base64"),
    (base64.b64encode(pickle.dumps(os.system)).decode(), "not one of torch's tensor rebuild functions"),
    (base64.b64encode(pickle.dumps([("a", 1)])).decode(), "list of \\(name, tensor\\) pairs"),
    (base64.b64encode(b"\x80\x04truncated").decode(), "cannot be unpickled"),
])
def test_the_receiver_refuses_what_is_not_a_list_of_named_tensors(payload, message):
    with pytest.raises(InvalidRequest, match=message) as info:
        deserialize_named_tensors(payload)
    assert info.value.field == "serialized_named_tensors"


def test_a_file_descriptor_payload_is_refused_with_the_reason():
    # torch's default sharing hands a descriptor to child processes only; an engine is not one
    buffer = io.BytesIO()
    from multiprocessing.reduction import ForkingPickler

    ForkingPickler(buffer).dump([("a", torch.ones(3))])
    with pytest.raises(InvalidRequest, match="file descriptor cannot reach an unrelated process"):
        deserialize_named_tensors(base64.b64encode(buffer.getvalue()).decode())
