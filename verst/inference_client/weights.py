"""The two weight wire formats between a trainer and its engines, both ends of each in one place: a
shared-memory bucket and a process-group broadcast. Importing this module imports torch.

Shared memory (`update_weights_from_tensor`, `load_format="shm"`): the sender copies all tensors into one
file under /dev/shm (tmpfs, i.e. shared memory), each at a 64-byte aligned offset, and sends a JSON
manifest `{"path": ..., "tensors": [{"name", "dtype", "shape", "offset"}, ...]}` as the single entry of
`serialized_named_tensors`. The engine copies from views of the mapped file straight into its parameters.
A transport's sender keeps its files (`ShmSlot`) and rewrites them at every push, and the engine keeps
them mapped (`ShmReader`): after the first push a bucket costs one copy on each side and no page faults.
On GPUs SGLang's own CUDA-IPC scheme replaces this one.

Broadcast (`init_weights_update_group` + `update_weights_from_distributed`): a standalone process group
(its own TCPStore, prefixed by the group name, gloo or NCCL) whose rank 0 is the trainer. With
`load_format="flattened_bucket"` (SGLang's) a bucket's tensors, all of one dtype, go end to end in one
broadcast, packed and received in buffers each side keeps (`FlatBuffer`); without it, one broadcast per
tensor in the order of `names`.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import datetime
import json
import mmap
import os
import threading
import uuid
import warnings
import weakref
from typing import Annotated, Any

import torch
from pydantic import BaseModel, Field, ValidationError

from verst.inference_client.protocol import InvalidRequest

SHM_DIR = "/dev/shm"
_ALIGN = 64
_MAP_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux


def dtype_of(name: str, field: str = "dtypes") -> torch.dtype:
    """torch dtype from its name ('float32', 'torch.bfloat16')."""
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise InvalidRequest(field, name, "not a torch dtype name (e.g. float32, bfloat16)")
    return dtype


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# ---- shared memory ----------------------------------------------------------------------------------
def shm_layout(named_tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[dict], int]:
    """Manifest entries (name, dtype, shape, 64-byte aligned offset) of tensors packed in one buffer, and its size."""
    entries, offset = [], 0
    for name, tensor in named_tensors:
        entries.append({"name": name, "dtype": dtype_name(tensor.dtype), "shape": list(tensor.shape), "offset": offset})
        offset += -(-tensor.numel() * tensor.element_size() // _ALIGN) * _ALIGN
    return entries, offset


class ShmSlot:
    """The sender's side of shared-memory transfers: one /dev/shm file, mapped once and rewritten by every
    `write` that fits (a bigger one replaces the file). Reusing it spares each push the allocation and page
    faults of a fresh file, most of a fresh file's cost. `close()` deletes the file (also done at exit)."""

    def __init__(self, directory: str = SHM_DIR):
        self.directory = directory
        self.path: str | None = None
        self.capacity = 0
        self._buffer: torch.Tensor | None = None
        self._finalizer: weakref.finalize | None = None

    def write(self, named_tensors: list[tuple[str, torch.Tensor]]) -> str:
        """Copy the tensors into the file; returns the manifest an engine reads them by."""
        entries, size = shm_layout(named_tensors)
        if self._buffer is None or size > self.capacity:
            self._allocate(max(size, 1))
        assert self._buffer is not None
        for (_, tensor), entry in zip(named_tensors, entries):
            _view(self._buffer, entry).copy_(tensor.detach())
        return json.dumps({"path": self.path, "tensors": entries})

    def _allocate(self, size: int) -> None:
        self.close()
        path = os.path.join(self.directory, f"verst-weights-{uuid.uuid4().hex}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        self._finalizer = weakref.finalize(self, _unlink, path)
        try:
            os.ftruncate(fd, size)
            # populated at once: one call instead of a page fault per page on the first write
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | _MAP_POPULATE,
                                prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.close()
            raise
        finally:
            os.close(fd)
        self.path, self.capacity = path, size
        self._buffer = torch.frombuffer(mapping, dtype=torch.uint8)

    def close(self) -> None:
        self._buffer, self.path, self.capacity = None, None, 0  # the mapping goes with its last view
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


@dataclasses.dataclass
class ShmBucket:
    """One shared-memory transfer in a file of its own: the manifest to send; `close()` deletes the file."""

    slot: ShmSlot
    manifest: str

    @property
    def path(self) -> str | None:
        return self.slot.path

    def close(self) -> None:
        self.slot.close()

    def __enter__(self) -> ShmBucket:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def write_shm_bucket(named_tensors: list[tuple[str, torch.Tensor]], directory: str = SHM_DIR) -> ShmBucket:
    """Copy tensors into one new shared-memory file; returns its manifest (sender side, one-off transfers;
    a transport reuses `ShmSlot`s)."""
    slot = ShmSlot(directory)
    try:
        return ShmBucket(slot, slot.write(named_tensors))
    except BaseException:
        slot.close()
        raise


class _ShmEntry(BaseModel):
    name: str
    dtype: str
    shape: list[Annotated[int, Field(ge=0)]]
    offset: int = Field(ge=0)


class _ShmManifest(BaseModel):
    path: str
    tensors: list[_ShmEntry]


class ShmReader:
    """The engine's side: tensors of a manifest as read-only views of the mapped file, to be copied into
    the parameters (`param.copy_(view)`). A file stays mapped while it exists unchanged (same inode and
    size), so a sender's reused slot costs no page faults after the first push; at most `keep` files stay
    mapped, and one found deleted or replaced is dropped at the next read."""

    def __init__(self, keep: int = 3):  # the tensor transport's three files
        self.keep = keep
        self._mapped: collections.OrderedDict[str, tuple[tuple[int, int, int], torch.Tensor]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def read(self, manifest: str) -> list[tuple[str, torch.Tensor]]:
        path, entries = _parse_manifest(manifest)
        with self._lock:
            buffer = self._buffer(path)
        size = buffer.numel()
        out = []
        for entry in entries:
            dtype = dtype_of(entry["dtype"], "serialized_named_tensors.dtype")
            end = entry["offset"] + _numel(entry["shape"]) * dtype.itemsize
            if end > size:
                raise InvalidRequest("serialized_named_tensors.offset", entry["offset"], f"outside the {size}-byte file")
            if entry["offset"] % dtype.itemsize:
                raise InvalidRequest("serialized_named_tensors.offset", entry["offset"],
                                     f"not aligned to the {dtype.itemsize}-byte elements of {entry['dtype']}")
            out.append((entry["name"], _view(buffer, entry)))
        return out

    def _buffer(self, path: str) -> torch.Tensor:
        for known in [p for p in self._mapped if p != path]:
            if _file_key(known) != self._mapped[known][0]:
                del self._mapped[known]  # deleted or replaced by its sender
        key = _file_key(path)
        if key is None:
            raise InvalidRequest("serialized_named_tensors.path", path, "no such shared-memory file")
        if key[2] == 0:
            raise InvalidRequest("serialized_named_tensors.path", path, "the shared-memory file is empty")
        cached = self._mapped.get(path)
        if cached is not None and cached[0] == key:
            self._mapped.move_to_end(path)
            return cached[1]
        buffer = _map_read_only(path, key[2])
        self._mapped[path] = (key, buffer)
        while len(self._mapped) > self.keep:
            self._mapped.popitem(last=False)
        return buffer


def _parse_manifest(manifest: str) -> tuple[str, list]:
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
    return path, [entry.model_dump() for entry in spec.tensors]


def _file_key(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino, stat.st_size


def _map_read_only(path: str, size: int) -> torch.Tensor:
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
    except OSError as exc:
        raise InvalidRequest("serialized_named_tensors.path", path, f"cannot be mapped ({exc})") from None
    with warnings.catch_warnings():
        # torch warns that it cannot mark a tensor read-only; these views are only ever copied from
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(mapping, dtype=torch.uint8)


_READER = ShmReader()


def read_shm_bucket(manifest: str) -> list[tuple[str, torch.Tensor]]:
    """Tensors of a shared-memory bucket, as read-only views of the mapped file (engine side)."""
    return _READER.read(manifest)


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _view(buffer: torch.Tensor, entry: dict) -> torch.Tensor:
    dtype = dtype_of(entry["dtype"], "serialized_named_tensors.dtype")
    nbytes = _numel(entry["shape"]) * dtype.itemsize
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
