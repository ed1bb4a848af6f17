"""Flow-GRPO's loss over denoising steps (Liu et al. 2025, arXiv:2505.05470, eq. 8).

A denoising step plays a token's part: each image's steps share its group-relative advantage, each step
has the ratio π_θ / π_old of its Gaussian transition, the PPO clip bounds it, and a KL estimate to the
reference policy's step log-probabilities is added with its coefficient. The mean is over all steps of all
images. `flow_grpo_token_loss` is the same clipped surrogate as a registered `algorithm.policy_loss`
("flow_grpo"), for the trainer's loss composition with steps in place of tokens.
"""

from __future__ import annotations

import torch

from verst.algo.kl import kl_estimate
from verst.algo.policy_loss import clipped_surrogate
from verst.config.schema import AlgorithmConfig


def flow_grpo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, *,
                   ref_logprobs: torch.Tensor | None = None, eps_clip: float = 1e-4, kl_coef: float = 0.0,
                   kl_estimator: str = "k3") -> tuple[torch.Tensor, dict[str, float]]:
    """Per-step logprobs (images, steps) and per-image advantages (images,) -> (loss, metrics)."""
    if logprobs.shape != old_logprobs.shape or logprobs.dim() != 2:
        raise ValueError(f"logprobs {tuple(logprobs.shape)} and old_logprobs {tuple(old_logprobs.shape)} "
                         "must both be (images, steps)")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages {tuple(advantages.shape)} must be one per image ({logprobs.shape[0]})")
    if kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef = {kl_coef} needs ref_logprobs, which was not given")
    step_adv = advantages[:, None].expand_as(logprobs)
    policy, clipped = clipped_surrogate(logprobs - old_logprobs.detach(), step_adv.detach(), eps_clip=eps_clip)
    loss = policy.mean()
    metrics = {"train/pg_loss": loss.item(), "train/pg_clipfrac": clipped.float().mean().item()}
    if kl_coef > 0:
        kl = kl_estimate(logprobs, ref_logprobs.detach(), kl_estimator).mean()
        loss = loss + kl_coef * kl
        metrics["train/kl"] = kl.item()
    metrics["train/loss"] = loss.item()
    return loss, metrics


def flow_grpo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                         loss_mask: torch.Tensor, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The registered policy loss: the clipped surrogate on each denoising step's ratio (no dual clip)."""
    return clipped_surrogate(logprobs - old_logprobs.detach(), advantages.detach(), eps_clip=cfg.eps_clip,
                             eps_clip_high=cfg.eps_clip_high)
