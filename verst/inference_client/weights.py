"""The process-group weight wire format between a trainer and its engines, both ends in one place (the
tensor format is `tensor_payload.py`). Importing this module imports torch.

Broadcast (`init_weights_update_group` + `update_weights_from_distributed`): a standalone process group
(its own TCPStore, prefixed by the group name, gloo or NCCL) whose rank 0 is the trainer. With
`load_format="flattened_bucket"` (SGLang's) a bucket's tensors, all of one dtype, go end to end in one
broadcast, packed and received in buffers each side keeps (`FlatBuffer`); without it, one broadcast per
tensor in the order of `names`.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Any

import torch

from verst.inference_client.protocol import InvalidRequest


def dtype_of(name: str, field: str = "dtypes") -> torch.dtype:
    """torch dtype from its name ('float32', 'torch.bfloat16')."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(field, name, "not a torch dtype name (e.g. float32, bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


# ---- process-group broadcast --------------------------------------------------------------------------
@dataclasses.dataclass
class WeightUpdateGroup:
    """A joined trainer -> engines group; holds the store, which must outlive the process group."""

    group: Any
    store: Any
    rank: int
    world_size: int
    name: str
    flat: FlatBuffer = dataclasses.field(default_factory=lambda: FlatBuffer())  # this member's bucket buffer

    def broadcast(self, tensors: list[torch.Tensor], src: int = 0) -> None:
        """Broadcast each tensor from `src` in order (the sender passes its tensors, receivers empty buffers)."""
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = src
        for tensor in tensors:
            self.group.broadcast([tensor], options).wait()


def open_weight_update_group(
    master_address: str, master_port: int, rank: int, world_size: int, group_name: str,
    backend: str = "gloo", timeout_s: float = 120.0,
) -> WeightUpdateGroup:
    """A process group of its own (not the default group), for trainer (rank 0) -> engines broadcasts.

    Every member calls this; it returns once all `world_size` ranks have joined. Rank 0 hosts the store.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=(rank == 0), timeout=timeout,
                          wait_for_workers=False)
    prefixed = dist.PrefixStore(f"verst/{group_name}", store)
    if backend == "gloo":
        group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
    elif backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    else:
        raise InvalidRequest("backend", backend, "choices: gloo, nccl")
    return WeightUpdateGroup(group=group, store=store, rank=rank, world_size=world_size, name=group_name)


def broadcast_tensors(group: WeightUpdateGroup, tensors: list[torch.Tensor], src: int = 0) -> None:
    """Sender side (rank `src`, the trainer) of one update: every tensor, in the order of `names`."""
    group.broadcast(tensors, src)


def receive_broadcast(
    group: WeightUpdateGroup, names: list[str], dtypes: list[str], shapes: list[list[int]],
    device: str | torch.device = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """Engine side of one `update_weights_from_distributed`: fresh buffers filled by rank 0's broadcast."""
    buffers = [torch.empty(shape, dtype=dtype_of(dt), device=device) for dt, shape in zip(dtypes, shapes)]
    group.broadcast(buffers, src=0)
    return list(zip(names, buffers))


# ---- flattened buckets ----------------------------------------------------------------------------------
FLATTENED = "flattened_bucket"  # SGLang's `load_format` for one broadcast per bucket


class FlatBuffer:
    """A byte buffer kept from one bucket to the next, grown when a bucket needs more: a flattened bucket
    (the tensors of one dtype end to end, SGLang's `flattened_bucket`) is packed or received in it without
    a fresh allocation and its page faults at every push."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = device
        self._bytes: torch.Tensor | None = None

    def take(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        """The first `numel` elements of the buffer as one flat `dtype` tensor."""
        nbytes = numel * dtype.itemsize
        if self._bytes is None or self._bytes.numel() < nbytes:
            self._bytes = None  # freed before the bigger one is allocated
            self._bytes = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=self.device)
        return self._bytes[:nbytes].view(dtype)

    def release(self) -> None:
        self._bytes = None


def flat_views(flat: torch.Tensor, shapes: list[list[int]]) -> list[torch.Tensor]:
    """The tensors of a flattened bucket, as views of `flat` in order."""
    views, start = [], 0
    for shape in shapes:
        n = _numel(shape)
        views.append(flat[start : start + n].view(shape))
        start += n
    return views


def one_dtype(dtypes: list[str]) -> torch.dtype | None:
    """The dtype every tensor of a bucket has, or None when they differ (no flattened bucket then)."""
    found = {dtype_of(name) for name in dtypes}
    return found.pop() if len(found) == 1 else None


def broadcast_flat(group: WeightUpdateGroup, tensors: list[torch.Tensor], buffer: FlatBuffer, src: int = 0) -> None:
    """Sender side of a flattened bucket: the tensors (one dtype) packed into `buffer`, then one broadcast."""
    flat = buffer.take(tensors[0].dtype, sum(t.numel() for t in tensors))
    for view, tensor in zip(flat_views(flat, [list(t.shape) for t in tensors]), tensors):
        view.copy_(tensor.detach())
    group.broadcast([flat], src)


def receive_flat(group: WeightUpdateGroup, names: list[str], dtypes: list[str],
                 shapes: list[list[int]]) -> list[tuple[str, torch.Tensor]]:
    """Engine side of a flattened bucket: one broadcast into the group's kept buffer; the tensors are views
    of it, copied into the parameters by the load (valid until the next bucket)."""
    dtype = one_dtype(dtypes)
    if dtype is None:
        raise InvalidRequest("dtypes", sorted(set(dtypes)), f"a {FLATTENED} holds tensors of one dtype")
    flat = group.flat.take(dtype, sum(_numel(shape) for shape in shapes))
    group.broadcast([flat], src=0)
    return list(zip(names, flat_views(flat, shapes)))
