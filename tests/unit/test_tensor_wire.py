"""Tensors between the driver and the trainer ranks (verst.orchestration.tensor_wire): every kind comes
back equal, with its dtype, shape and requires_grad, and plain ones as writable memory of their own."""

import pickle

import pytest
import torch

from verst.orchestration.tensor_wire import from_wire, to_wire

KINDS = {
    "float32": torch.randn(3, 4),
    "transposed": torch.randn(4, 3).t(),
    "scalar": torch.tensor(2.5),
    "empty": torch.zeros(0, 3),
    "int64": torch.arange(10),
    "bool": torch.tensor([True, False, True]),
    "bfloat16": torch.randn(6).to(torch.bfloat16),
    "requires_grad": torch.randn(2, requires_grad=True),
    "conjugate view": torch.randn(3, dtype=torch.complex64).conj(),
}


def round_trip(tensor):
    return from_wire(pickle.loads(pickle.dumps(to_wire(tensor), protocol=5)))


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_comes_back_equal(kind):
    sent = KINDS[kind]
    got = round_trip(sent)
    assert (got.dtype, got.shape, got.requires_grad) == (sent.dtype, sent.shape, sent.requires_grad)
    assert torch.equal(got.detach().resolve_conj(), sent.detach().resolve_conj())


def test_plain_tensors_travel_as_bytes_and_come_back_writable():
    sent = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    wire = to_wire(sent)
    assert wire[0] == "bytes" and wire[2:] == ("float32", (2, 3))
    data = wire[1].copy()
    data.flags.writeable = False  # as Ray hands out its object store's buffers
    got = from_wire(("bytes", data, "float32", (2, 3)))
    got += 1  # its own memory: neither the buffer nor the sender changes
    assert torch.equal(sent, torch.arange(6, dtype=torch.float32).reshape(2, 3)) and got[0, 0] == 1


def test_tensors_needing_grad_keep_torchs_own_pickling():
    assert to_wire(torch.ones(2, requires_grad=True))[0] == "torch"
