"""One Flow-GRPO step on a denoiser: sample groups of images per prompt with the SDE sampler, score them,
group-relative advantages (the GRPO estimator), and optimizer steps on the clipped ratio over the steps.

The sampler's recorded step log-probabilities are the old policy's; the reference's come from a frozen copy
of the base denoiser when `kl_coef > 0`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verst.algo.advantages import group_relative_rewards
from verst.algo.flow_grpo import flow_grpo_loss
from verst.models import diffusion


@dataclass
class FlowGRPOSettings:
    group_size: int = 8
    steps: int = 10
    guidance: float = 1.0
    noise_level: float = 0.7
    eps_clip: float = 0.2
    kl_coef: float = 0.0
    lr: float = 3e-5
    epochs: int = 1
    micro_batch: int = 16


def flow_grpo_step(model, optimizer: torch.optim.Optimizer, labels: torch.Tensor,
                   reward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], settings: FlowGRPOSettings, *,
                   seed: int, reference=None) -> dict[str, float]:
    """Sample `group_size` images for each label, score, and train on them -> metrics."""
    group_labels = labels.repeat_interleave(settings.group_size)
    group_ids = torch.arange(labels.shape[0]).repeat_interleave(settings.group_size)
    model.eval()
    traj = diffusion.sample(model, group_labels, seed=seed, steps=settings.steps, guidance=settings.guidance,
                            noise_level=settings.noise_level)
    rewards = reward(traj.images, group_labels).float()
    advantages = group_relative_rewards(rewards, group_ids, std_normalize=True)
    ref_logprobs = None
    if settings.kl_coef > 0:
        with torch.no_grad():
            ref_logprobs = diffusion.step_logprobs(reference, traj.latents, group_labels, guidance=settings.guidance,
                                                   noise_level=settings.noise_level)
    metrics: dict[str, float] = {"rollout/reward_mean": rewards.mean().item()}
    model.train()
    n = group_labels.shape[0]
    for _ in range(settings.epochs):  # one optimizer step per epoch, gradients accumulated over micro-batches
        optimizer.zero_grad()
        for start in range(0, n, settings.micro_batch):
            part = slice(start, start + settings.micro_batch)
            logprobs = diffusion.step_logprobs(model, traj.latents[part], group_labels[part],
                                               guidance=settings.guidance, noise_level=settings.noise_level)
            loss, step_metrics = flow_grpo_loss(
                logprobs, traj.logprobs[part], advantages[part], eps_clip=settings.eps_clip,
                kl_coef=settings.kl_coef, ref_logprobs=None if ref_logprobs is None else ref_logprobs[part])
            (loss * logprobs.shape[0] / n).backward()
            metrics.update(step_metrics)
        optimizer.step()
    model.eval()
    return metrics
