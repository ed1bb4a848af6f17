"""The broadcast wire format's own mechanics: a flattened bucket's kept buffer, its layout, and buckets of
one dtype."""

import torch

from verst.inference_client.weights import FlatBuffer, flat_views, one_dtype
from verst.sync.buckets import rebucket


def named(seed, sizes=(3, 5)):
    g = torch.Generator().manual_seed(seed)
    return [(f"t{i}", torch.randn(n, 2, generator=g)) for i, n in enumerate(sizes)]


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
