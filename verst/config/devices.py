"""What device a run's config means on this machine, answered without importing torch (config loading and
`--dry-run` stay torch-free)."""

from __future__ import annotations

import os
from pathlib import Path


def on_cuda(device: str) -> bool:
    """Whether `cluster.device` means CUDA here: 'cuda', or 'auto' on a machine with an NVIDIA GPU (its device
    files; torch is not imported to find out)."""
    if device != "auto":
        return device == "cuda"
    return cuda_visible()


def cuda_visible() -> bool:
    """An NVIDIA GPU is visible to this process (the driver's device files), without importing torch."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return Path("/dev/nvidiactl").exists() and any(Path("/dev").glob("nvidia[0-9]*"))
