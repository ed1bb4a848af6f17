"""AdamW and the learning-rate schedule of `TrainerConfig`: linear warm-up, then constant, cosine
or linear decay to `min_lr_ratio × lr` at `total_steps`.
"""

from __future__ import annotations

import math

import torch

from verst.config.schema import TrainerConfig


def lr_factor(step: int, cfg: TrainerConfig, total_steps: int | None) -> float:
    """Multiplier of the peak lr for optimizer step `step` (0-based)."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return 1.0
    if total_steps is None:
        raise ValueError(f"trainer.lr_schedule = {cfg.lr_schedule!r} needs the total number of train steps")
    decay_steps = max(total_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay_steps, 1.0)
    if cfg.lr_schedule == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        shape = 1.0 - progress
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def build_optimizer(
    model: torch.nn.Module, cfg: TrainerConfig, total_steps: int | None
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW (no weight decay on 1-D parameters: norms and biases) and its LambdaLR schedule."""
    if cfg.lr_schedule != "constant" and (total_steps is None or total_steps < 1):
        raise ValueError(
            f"trainer.lr_schedule = {cfg.lr_schedule!r} needs total_steps >= 1, got {total_steps}"
        )
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    # fused: one kernel per step instead of one op per parameter, which matters most for sharded
    # (DTensor) parameters, where every op pays a sharding-propagation cost.
    optimizer = torch.optim.AdamW(groups, lr=cfg.lr, betas=tuple(cfg.adam_betas), fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, cfg, total_steps))
    return optimizer, scheduler
