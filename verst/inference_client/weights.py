"""The two weight wire formats between a trainer and its engines, both ends of each in one place: a
shared-memory bucket and a process-group broadcast. Importing this module imports torch.

Shared memory (`update_weights_from_tensor`, `load_format="shm"`): the sender copies all tensors into one
file under /dev/shm (tmpfs, i.e. shared memory), each at a 64-byte aligned offset, and sends a JSON
manifest `{"path": ..., "tensors": [{"name", "dtype", "shape", "offset"}, ...]}` as the single entry of
`serialized_named_tensors`. The engine maps the file read-only and copies into its parameters; the sender
deletes the file once the engine has replied. On GPUs SGLang's own CUDA-IPC scheme replaces this one.

Broadcast (`init_weights_update_group` + `update_weights_from_distributed`): a standalone process group
(its own TCPStore, prefixed by the group name, gloo or NCCL) whose rank 0 is the trainer; tensors are
broadcast one by one in the order of `names`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import uuid
from typing import Annotated, Any

import torch
from pydantic import BaseModel, Field, ValidationError

from verst.inference_client.protocol import InvalidRequest

SHM_DIR = "/dev/shm"
_ALIGN = 64


def dtype_of(name: str, field: str = "dtypes") -> torch.dtype:
    """torch dtype from its name ('float32', 'torch.bfloat16')."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(field, name, "not a torch dtype name (e.g. float32, bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- shared memory ----------------------------------------------------------------------------------
@dataclasses.dataclass
class ShmBucket:
    """The sender's side of one shared-memory transfer: the manifest to send and the file to delete."""

    path: str
    manifest: str
    nbytes: int

    def close(self) -> None:
        if os.path.exists(self.path):
            os.unlink(self.path)

    def __enter__(self) -> ShmBucket:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_shm_bucket(named_tensors: list[tuple[str, torch.Tensor]], directory: str = SHM_DIR) -> ShmBucket:
    """Copy tensors into one new shared-memory file; returns its manifest (sender side)."""
    entries, offset = [], 0
    for name, tensor in named_tensors:
        entries.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "offset": offset})
        offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    path = os.path.join(directory, f"verst-weights-{uuid.uuid4().hex}")
    buffer = torch.from_file(path, shared=True, size=max(offset, 1), dtype=torch.uint8)
    try:
        for (_, tensor), entry in zip(named_tensors, entries):
            _view(buffer, entry).copy_(tensor.detach().to("cpu"))
    except BaseException:
        os.unlink(path)
        raise
    del buffer
    return ShmBucket(path=path, manifest=json.dumps({"path": path, "tensors": entries}), nbytes=offset)


class _ShmEntry(BaseModel):
    name: str
    dtype: str
    shape: list[Annotated[int, Field(ge=0)]]
    offset: int = Field(ge=0)


class _ShmManifest(BaseModel):
    path: str
    tensors: list[_ShmEntry]


def read_shm_bucket(manifest: str) -> list[tuple[str, torch.Tensor]]:
    """Tensors of a shared-memory bucket, as read-only views of the mapped file (engine side)."""
    try:
        spec = _ShmManifest.model_validate_json(manifest)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        where = ".".join(str(p) for p in error["loc"])
        raise InvalidRequest("serialized_named_tensors", manifest,
                             f"not a shm manifest ({where or 'manifest'}: {error['msg']})") from None
    path = spec.path
    if not path.startswith(SHM_DIR + "/") or ".." in path or "\0" in path:
        raise InvalidRequest("serialized_named_tensors.path", path, f"must be a file under {SHM_DIR}")
    if not os.path.isfile(path):
        raise InvalidRequest("serialized_named_tensors.path", path, "no such shared-memory file")
    size = os.path.getsize(path)
    if size == 0:
        raise InvalidRequest("serialized_named_tensors.path", path, "the shared-memory file is empty")
    try:
        buffer = torch.from_file(path, shared=False, size=size, dtype=torch.uint8)
    except RuntimeError as exc:
        raise InvalidRequest("serialized_named_tensors.path", path, f"cannot be mapped ({exc})") from None
    out = []
    for entry in (e.model_dump() for e in spec.tensors):
        dtype = dtype_of(entry["dtype"], "serialized_named_tensors.dtype")
        itemsize = torch.empty((), dtype=dtype).element_size()
        end = entry["offset"] + _numel(entry["shape"]) * itemsize
        if end > size:
            raise InvalidRequest("serialized_named_tensors.offset", entry["offset"], f"outside the {size}-byte file")
        if entry["offset"] % itemsize:
            raise InvalidRequest("serialized_named_tensors.offset", entry["offset"],
                                 f"not aligned to the {itemsize}-byte elements of {entry['dtype']}")
        out.append((entry["name"], _view(buffer, entry)))
    return out


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _view(buffer: torch.Tensor, entry: dict) -> torch.Tensor:
    dtype = dtype_of(entry["dtype"], "serialized_named_tensors.dtype")
    nbytes = _numel(entry["shape"]) * torch.empty((), dtype=dtype).element_size()
    start = entry["offset"]
    return buffer[start : start + nbytes].view(dtype).view(entry["shape"])


# ---- process-group broadcast --------------------------------------------------------------------------
@dataclasses.dataclass
class WeightUpdateGroup:
    """A joined trainer -> engines group; holds the store, which must outlive the process group."""

    group: Any
    store: Any
    rank: int
    world_size: int
    name: str

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
