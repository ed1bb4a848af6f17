"""What the device makes impossible, refused when the config loads: each rule one function raising
`ValueError` that names the fields and the choices. Torch is imported only where `cluster.device = "auto"`
leaves the question to the machine.
"""

from __future__ import annotations

from typing import Any


def on_cuda(device: str) -> bool:
    """Whether cluster.device means CUDA here: 'cuda', or 'auto' where torch sees a CUDA device."""
    if device != "auto":
        return device == "cuda"
    import torch

    return torch.cuda.is_available()


def check_colocated_broadcast(cfg: Any) -> None:
    """Colocated on CUDA, a trainer rank and its engine share one GPU, and NCCL refuses two ranks of one
    group on one device: the `distributed` transport's broadcast cannot form."""
    if cfg.cluster.placement != "colocated" or cfg.sync.transport != "distributed":
        return
    if on_cuda(cfg.cluster.device):
        raise ValueError(
            f"sync.transport = 'distributed' with cluster.placement = 'colocated' on cluster.device = "
            f"{cfg.cluster.device!r} (CUDA): the trainer and an engine share a GPU, and NCCL refuses two ranks of "
            "one group on one GPU; use sync.transport = 'tensor' (CUDA-IPC handles) or 'disk'")
