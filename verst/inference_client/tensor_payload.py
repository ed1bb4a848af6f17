"""SGLang's tensor wire format, both ends: `update_weights_from_tensor`'s `serialized_named_tensors` entry is
a list of `(name, tensor)` pickled with torch's multiprocessing reductions and base64-encoded, as SGLang's
`MultiprocessingSerializer` writes it. Importing this module imports torch.

One code path for both devices: a CUDA tensor travels as a CUDA-IPC handle, its device named by UUID (SGLang's
reduction patch does the same, so engines that see the GPU under another index map it right); a CPU tensor
travels as a shared-memory storage named by its /dev/shm file (torch's `file_system` sharing). The default
`file_descriptor` sharing cannot serve here: it hands a descriptor over a socket that only a child of the
sender (same multiprocessing authkey) may connect to, and an engine is not the trainer's child.

Lifetime of a CPU storage's file: pickling takes a reference that the receiver's unpickling gives back, so
each receiver needs a pickle of its own (`serialize_named_tensors` once per engine and rank). The file is
deleted once the sender and every receiver have dropped the storage; a pickle never unpickled (its engine
died) keeps it until the sender exits, when torch's shared-memory manager deletes it.

The receiving end unpickles only torch's rebuild functions and types: a payload naming anything else is
refused by name, never executed.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
import torch.multiprocessing  # registers torch's reductions with ForkingPickler
from torch.multiprocessing import reductions

from verst.inference_client.protocol import InvalidRequest

FIELD = "serialized_named_tensors"
_DEVICE_ARG = 6  # the device's position among `rebuild_cuda_tensor`'s arguments


# ---- sender ---------------------------------------------------------------------------------------------
def serialize_named_tensors(named: list[tuple[str, torch.Tensor]]) -> str:
    """One `serialized_named_tensors` entry: CUDA tensors as IPC handles, CPU tensors as shared-memory
    storages (a storage not yet in shared memory is moved there, one copy). The tensors must stay alive
    until the receiver has copied them (the reply to its load)."""
    buffer = io.BytesIO()
    _Pickler(buffer).dump([(name, tensor.detach()) for name, tensor in named])
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class _Pickler(ForkingPickler):
    """ForkingPickler with torch's reductions, CPU storages shared by file name and CUDA devices by UUID."""

    def __init__(self, file: io.BytesIO):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.dispatch_table[torch.UntypedStorage] = _reduce_storage_by_file
        for cls in (torch.Tensor, torch.nn.Parameter):
            self.dispatch_table[cls] = _reduce_tensor


def _reduce_tensor(tensor: torch.Tensor) -> tuple:
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.device.type == "cuda":
        args = (*args[:_DEVICE_ARG], device_uuid(args[_DEVICE_ARG]), *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def _reduce_storage_by_file(storage: torch.UntypedStorage) -> tuple:
    """torch's `file_system` reduction of a CPU storage, whatever the process's sharing strategy."""
    if storage.device.type != "cpu":
        raise ValueError(f"a {storage.device.type} storage is shared through its tensor, not on its own")
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's `rebuild_storage_filename` gives this reference back
    return reductions.rebuild_storage_filename, (type(storage), manager, handle, size)


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


class SharedStaging:
    """The sender's CPU buffer in shared memory, kept and reused by every push: tensors copied into it go out
    as views of one storage, so a push after the first costs a copy and no fresh pages. Grows (a new file)
    when a push needs more; `close()` drops it (its file goes once the engines have dropped it too)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def stage(self, named: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Copies of `named` in the buffer, 64-byte aligned, as views of it."""
        offsets, end = [], 0
        for _, tensor in named:
            offsets.append(end)
            end += -(-tensor.numel() * tensor.element_size() // 64) * 64
        if self._buffer is None or self._buffer.numel() < end:
            self._buffer = None  # the old file goes before the bigger one is made
            self._buffer = torch.empty(max(end, 1), dtype=torch.uint8)
            self._buffer.untyped_storage()._share_filename_cpu_()
        out = []
        for (name, tensor), start in zip(named, offsets):
            nbytes = tensor.numel() * tensor.element_size()
            view = self._buffer[start : start + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor.detach())
            out.append((name, view))
        return out

    def close(self) -> None:
        self._buffer = None


# ---- receiver -------------------------------------------------------------------------------------------
def deserialize_named_tensors(payload: str) -> list[tuple[str, torch.Tensor]]:
    """The `(name, tensor)` list of one entry: CPU tensors are views of the sender's shared-memory files,
    CUDA tensors of its device memory, valid until dropped. Anything else is refused naming the field."""
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(FIELD, payload, "not base64 (SGLang's MultiprocessingSerializer output)") from None
    try:
        named = _Unpickler(io.BytesIO(data)).load()
    except InvalidRequest:
        raise
    except Exception as exc:  # a truncated or foreign pickle, a shared-memory file that is gone
        raise InvalidRequest(FIELD, payload, f"cannot be unpickled ({type(exc).__name__}: {exc})") from None
    if not (isinstance(named, list) and all(_is_named_tensor(item) for item in named)):
        raise InvalidRequest(FIELD, payload, "does not hold a list of (name, tensor) pairs")
    return [(name, tensor) for name, tensor in named]


def _is_named_tensor(item: Any) -> bool:
    return isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], torch.Tensor)


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    """torch's `rebuild_cuda_tensor`, with the device named by UUID (SGLang's patch) or by index."""
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        device = _device_index(device)
    return reductions.rebuild_cuda_tensor(*args[:_DEVICE_ARG], device, *args[_DEVICE_ARG + 1 :])


def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise InvalidRequest(FIELD, uuid, f"names a CUDA device this engine does not see ({torch.cuda.device_count()} "
                         "visible): trainer and engine must share the GPU")


_REBUILDS = {
    "rebuild_tensor": reductions.rebuild_tensor,
    "rebuild_typed_storage": reductions.rebuild_typed_storage,
    "rebuild_storage_filename": reductions.rebuild_storage_filename,
    "rebuild_storage_empty": reductions.rebuild_storage_empty,
    "rebuild_cuda_tensor": _rebuild_cuda_tensor,
}
_TYPES = {
    ("torch", "Tensor"): torch.Tensor, ("torch._tensor", "Tensor"): torch.Tensor, ("torch", "Size"): torch.Size,
    ("torch.nn.parameter", "Parameter"): torch.nn.Parameter, ("torch.storage", "TypedStorage"): torch.TypedStorage,
    ("torch", "UntypedStorage"): torch.UntypedStorage, ("torch.storage", "UntypedStorage"): torch.UntypedStorage,
}
# SGLang's reduction patch pickles its own CUDA rebuild function under its module; the engine maps it to its own.
_SGLANG_CUDA_REBUILD = "_rebuild_cuda_tensor_modified"


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch.multiprocessing.reductions" and name in _REBUILDS:
            return _REBUILDS[name]
        if module.startswith("sglang.") and name == _SGLANG_CUDA_REBUILD:
            return _rebuild_cuda_tensor
        if (module, name) in _TYPES:
            return _TYPES[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        hint = (" (a file descriptor cannot reach an unrelated process; share CPU tensors by file name, torch's "
                "file_system strategy)" if name == "rebuild_storage_fd" or module.startswith("multiprocessing") else "")
        raise InvalidRequest(FIELD, f"{module}.{name}", f"not one of torch's tensor rebuild functions or types{hint}")
