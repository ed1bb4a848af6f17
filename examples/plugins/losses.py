"""Loss plug-ins (`algorithm.mismatch_fn`, `algorithm.policy_loss_fn`, `algorithm.loss_reducer`): plain
functions over [batch, resp_len] tensors, called in the train step on every micro-batch.

    [algorithm]
    mismatch_fn = "examples.plugins.losses:truncate_high_mask_low"
    policy_loss_fn = "examples.plugins.losses:cispo"
    loss_aggregation = "seq_mean_token_sum"
    loss_reducer = "examples.plugins.losses:token_sum_over_budget"
"""

from __future__ import annotations

import torch

from verst.config import AlgorithmConfig

GENERATION_BUDGET = 1024  # tokens: the constant that replaces each sequence's length


def truncate_high_mask_low(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
    clip_low: float, clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A mismatch correction: the ratio ρ = π_old/π_rollout truncated at `clip_high` (TIS) and tokens with
    ρ < `clip_low` dropped (weight 0, flagged). Returns (weights, flags), both [batch, resp_len]."""
    rho = torch.exp((old_logprobs - rollout_logprobs).clamp(-20.0, 20.0))
    rejected = (rho < clip_low) & (loss_mask != 0)
    return torch.where(rejected, 0.0, rho.clamp(max=clip_high)), rejected


def cispo(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
    cfg: AlgorithmConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1, arXiv:2506.13585): −sg(clip(ρ, 0, 1 + ε_high))·A·log π per token. The clip bounds
    the importance weight but, unlike PPO's, never removes a token's gradient. Returns (token_loss,
    clipped): `clipped` marks the tokens whose weight was capped (`train/pg_clipfrac`)."""
    eps_high = cfg.eps_clip_high if cfg.eps_clip_high is not None else cfg.eps_clip
    ratio = torch.exp((logprobs.detach() - old_logprobs).clamp(-20.0, 20.0))
    weight = ratio.clamp(max=1.0 + eps_high)
    return -weight * advantages * logprobs, ratio > 1.0 + eps_high


def token_sum_over_budget(token_values: torch.Tensor, loss_mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """A reducer: each sequence's token sum over a fixed budget, averaged over sequences (Dr.GRPO's constant
    normaliser, Liu et al. 2025, arXiv:2503.20783). Its unit is the sequence, so it needs a per-sequence
    `algorithm.loss_aggregation`."""
    if aggregation == "token_mean":
        raise ValueError("token_sum_over_budget averages over sequences; set loss_aggregation = 'seq_mean_token_sum'")
    masked = torch.where(loss_mask != 0, token_values, 0.0)
    sequences = (loss_mask != 0).any(dim=-1).sum().clamp(min=1)
    return masked.sum() / (sequences * GENERATION_BUDGET)
