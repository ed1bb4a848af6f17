"""Releasing and resuming the engine's memory while a colocated trainer steps (SGLang's
`/release_memory_occupation` and `/resume_memory_occupation`, by tag): `kv_cache` drops the KV slots and the
prefix cache, `weights` moves the weights to pinned host memory and back (CUDA; on the CPU they are host
memory already and stay). Runs on the engine thread, between steps.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import itertools
import logging
from typing import Any

import torch

from verst.inference_client.protocol import InvalidRequest

log = logging.getLogger(__name__)
TAGS = ("weights", "kv_cache")


def release_memory(core: Any, tags: list[str] | None) -> dict[str, int]:
    """Release `tags` (None: all); returns the bytes each freed. Refused while requests are in flight or a
    tag is released already, naming it."""
    chosen = _chosen(tags)
    already = sorted(set(chosen) & core.released)
    if already:
        raise InvalidRequest("tags", already, "released already; /resume_memory_occupation first")
    in_flight = len(core.running) + len(core.waiting)
    if in_flight:
        raise InvalidRequest("tags", chosen, f"{in_flight} requests are in flight: release needs an idle engine "
                             "(let them finish, or /pause_generation with mode = 'abort')")
    freed = {}
    if "kv_cache" in chosen:
        freed["kv_cache"] = core.runner.cache.nbytes() + core.prefix_cache.nbytes()
        core.prefix_cache.flush()
        core.runner.cache.clear()
    if "weights" in chosen:
        freed["weights"] = _move_weights(core.model, torch.device("cpu")) if core.runner.device.type != "cpu" else 0
    core.released = core.released | set(chosen)
    _return_freed_memory(core.runner.device)
    log.info("released %s", freed)
    return freed


def resume_memory(core: Any, tags: list[str] | None) -> list[str]:
    """Undo `release_memory` for `tags` (None: every released one); the KV storage grows back as requests
    need it. Refused for a tag that is not released, naming it."""
    chosen = sorted(core.released) if tags is None else _chosen(tags)
    not_released = sorted(set(chosen) - core.released)
    if not_released:
        raise InvalidRequest("tags", not_released, "not released (/release_memory_occupation releases them)")
    if "weights" in chosen and core.runner.device.type != "cpu":
        _move_weights(core.model, core.runner.device)
    core.released = core.released - set(chosen)
    return chosen


def device_memory_bytes(device: torch.device) -> int:
    """What the CUDA caching allocator holds on `device` (allocated and cached blocks); 0 on the CPU."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def _chosen(tags: list[str] | None) -> list[str]:
    chosen = list(TAGS) if tags is None else list(dict.fromkeys(tags))
    unknown = [tag for tag in chosen if tag not in TAGS]
    if unknown:
        raise InvalidRequest("tags", unknown, f"choices: {', '.join(TAGS)}")
    return chosen


def _move_weights(model: torch.nn.Module, device: torch.device) -> int:
    """Every parameter and buffer to `device` in place (the tensors keep their identity, so the engine's
    tables of them stay valid); host copies are pinned so the way back is one fast copy. Returns the bytes."""
    moved = 0
    with torch.no_grad():
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            source = tensor.data
            if device.type == "cpu":
                target = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
                target.copy_(source)
            else:
                target = source.to(device, non_blocking=True)
            tensor.data = target
            moved += source.numel() * source.element_size()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return moved


def _return_freed_memory(device: torch.device) -> None:
    """Hand what was freed back to the system: the CUDA caching allocator's blocks, and on the host the
    pages glibc's allocator keeps in its arenas after a free (without `malloc_trim` the process's resident
    memory would not fall)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    libc_name = ctypes.util.find_library("c")
    libc = ctypes.CDLL(libc_name) if libc_name else None
    if libc is not None and hasattr(libc, "malloc_trim"):  # glibc only
        libc.malloc_trim(0)
