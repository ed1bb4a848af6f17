"""How torch tensors cross Ray between the driver and the trainer ranks: as their raw bytes in a NumPy
array, which Ray's pickle 5 path carries as one out-of-band buffer.

torch's own pickling writes each tensor's storage through `torch.save` and reads it back through
`torch.load`: for a train step's items (a few small tensors per sample) that took 37% of a trainer
rank's time on the chain task here (py-spy), as much as the forward and backward passes. The receiver
gets a writable copy (Ray's buffers are read-only). Tensors this path does not cover (on an accelerator,
requiring grad, sparse, quantized, or a conjugate/negative view) keep torch's own pickling, unchanged.
"""

from __future__ import annotations

import ray
import torch


def to_wire(tensor: torch.Tensor) -> tuple:
    """Plain CPU tensors as ("bytes", uint8 array, dtype name, shape); the rest as ("torch", the
    reconstruction torch's own pickling would use). The sent tensor's storage becomes non-resizable
    (torch's rule for a storage NumPy views): send a copy of one whose owner resizes it."""
    plain = (tensor.device.type == "cpu" and tensor.layout == torch.strided and not tensor.requires_grad
             and not tensor.is_quantized and not tensor.is_conj() and not tensor.is_neg())
    if not plain:
        rebuild = tensor.__reduce_ex__(5)
        if len(rebuild) != 2:
            raise TypeError(f"cannot send a {tensor.dtype} tensor on {tensor.device}: torch's reduction has "
                            f"{len(rebuild)} parts, expected (callable, args)")
        return ("torch", rebuild)
    flat = tensor.contiguous().reshape(-1)
    return ("bytes", flat.view(torch.uint8).numpy(), str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


def from_wire(wire: tuple) -> torch.Tensor:
    """The tensor `to_wire` sent; plain ones as a writable copy (Ray's buffers are read-only)."""
    if wire[0] == "torch":
        rebuild, args = wire[1]
        return rebuild(*args)
    _, data, dtype, shape = wire
    if data.size == 0:  # an empty byte view cannot be reinterpreted as a wider dtype
        return torch.empty(shape, dtype=getattr(torch, dtype))
    return torch.from_numpy(data.copy()).view(getattr(torch, dtype)).reshape(shape)


def register_tensor_serializer() -> None:
    """Send torch tensors from this process as `to_wire` does; the receiver needs nothing registered
    (the pickle names `from_wire`). Idempotent; needs a connected Ray (driver or actor)."""
    ray.util.register_serializer(torch.Tensor, serializer=to_wire, deserializer=from_wire)
