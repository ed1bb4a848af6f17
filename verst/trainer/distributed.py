"""Process-group set-up for trainer ranks: gloo on CPU, NCCL (plus gloo for CPU objects) on GPU.

Used by every host of a rank (the Ray rank actors of `verst.orchestration`, torchrun).
"""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def resolve_device(device: str) -> torch.device:
    """'auto' -> cuda when available; a GPU rank takes cuda:LOCAL_RANK."""
    if device not in ("auto", "cpu", "cuda"):
        raise ValueError(f"trainer device {device!r} is not one of 'auto', 'cpu', 'cuda'")
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("trainer device 'cuda' was asked for but torch sees no CUDA device")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


def init_process_group(
    rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
    timeout_s: float = 600.0,
) -> None:
    """Join the trainer's process group at the rendezvous store `master_addr:master_port`, which rank 0
    serves itself (the torchrun arrangement)."""
    if dist.is_initialized():
        raise RuntimeError("a torch.distributed process group is already initialised in this process")
    os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(rank),
                      WORLD_SIZE=str(world_size))
    store = dist.TCPStore(master_addr, master_port, world_size, is_master=rank == 0,
                          timeout=datetime.timedelta(seconds=timeout_s))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def ensure_single_process_group(device: torch.device) -> None:
    """For in-process use with one rank: a world of one over an in-memory store."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def gather_objects(group: dist.ProcessGroup | None, value: object) -> list:
    """Every rank's `value`, by rank (collective over `group`, None: the default group)."""
    if dist.get_world_size() == 1:
        return [value]
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, value, group=group)
    return parts


def data_by(axis: str, size: int, field: str, device_type: str, world_size: int) -> DeviceMesh:
    """The trainer ranks as [dp, `axis`] named ("dp", `axis`): a group on `axis` holds `size` consecutive ranks
    (`field`'s value, which must divide them)."""
    if world_size % size:
        raise ValueError(f"{field} = {size} does not divide the {world_size} trainer ranks")
    return init_device_mesh(device_type, (world_size // size, size), mesh_dim_names=("dp", axis))


def join_ranks(device: str, seed: int) -> tuple[torch.device, int, int]:
    """A backend's device (`resolve_device`), rank and world size in the default process group (made for one rank
    when there is none), with torch's RNG seeded `seed + rank`."""
    resolved = resolve_device(device)
    ensure_single_process_group(resolved)
    rank = dist.get_rank()
    torch.manual_seed(seed + rank)
    return resolved, rank, dist.get_world_size()
