"""Train–inference mismatch: weights on the policy loss from rollout vs trainer old logprobs.

The engine's sampling policy π_rollout and the trainer's π_old differ numerically (kernels, precision);
ρ_t = π_old(y_t) / π_rollout(y_t) corrects for it (decoupled, three-policy PPO).
"""

from __future__ import annotations

import math

import torch

from verst.algo.aggregation import aggregate, check_token_shapes, clamped_exp, metric_aggregation
from verst.algo.kl import kl_estimate

CORRECTIONS: tuple[str, ...] = ("none", "tis", "mis_token", "mis_sequence", "mis_geometric", "icepop")


def mismatch_weights(
    mode: str,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights on the policy loss and the tokens they clip or reject, both [batch, resp_len].

    With log ρ_t = log π_old(y_t) − log π_rollout(y_t) and the band [clip_low, clip_high]:
    - `tis`: w_t = clip(ρ_t, low, high), truncated importance sampling (Yao et al. 2025, "Your
      Efficient RL Framework Secretly Brings You Off-Policy RL Training"; flag = clipped);
    - `mis_token`: w_t = ρ_t inside the band, 0 outside (masked importance sampling, Liu et al. 2025,
      "When Speed Kills Stability"; also IcePop's M(k) in the Ring-1T report, inclusionAI 2025);
    - `mis_sequence`: the same test and weight with the sequence ratio ρ = Π_t ρ_t;
    - `mis_geometric`: with the geometric mean ρ = exp(mean_t log ρ_t), a length-independent band;
    - `icepop`: the token band as a pure mask (1 inside, 0 outside), no reweighting.
    For the `mis_*`/`icepop` modes the flag marks rejected tokens. Weights carry no gradient; the
    band test is done on log ρ, so extreme ratios are rejected exactly and weights stay finite.
    """
    if mode not in CORRECTIONS or mode == "none":
        raise ValueError(f"mismatch_correction {mode!r} has no weights; expected one of {CORRECTIONS[1:]}")
    if not 0.0 <= clip_low < clip_high:
        raise ValueError(f"need 0 <= tis_clip_low < tis_clip; got tis_clip_low={clip_low}, tis_clip={clip_high}")
    check_token_shapes(loss_mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    mask = loss_mask != 0
    log_rho = torch.where(mask, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)  # [batch, resp_len]
    if mode == "mis_sequence":
        log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
    elif mode == "mis_geometric":
        tokens = mask.sum(dim=-1, keepdim=True).clamp(min=1)
        log_rho = (log_rho.sum(dim=-1, keepdim=True) / tokens).expand_as(log_rho)
    log_low = math.log(clip_low) if clip_low > 0 else -math.inf
    outside = (log_rho < log_low) | (log_rho > math.log(clip_high))
    rho = clamped_exp(log_rho)
    if mode == "tis":
        return rho.clamp(clip_low, clip_high), outside
    keep = torch.where(outside, 0.0, 1.0).to(rho.dtype)
    return (keep if mode == "icepop" else rho * keep), outside


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    aggregation: str,
) -> dict[str, float]:
    """`train/rollout_logprob_abs_diff` (|log π_old − log π_rollout|) and `train/rollout_kl`
    (k3 estimate of KL(π_rollout ‖ π_old) on the rollout's tokens): local means by `metric_aggregation`."""
    old, rollout = old_logprobs.detach(), rollout_logprobs.detach()
    mode = metric_aggregation(aggregation)
    abs_diff = aggregate((old - rollout).abs(), loss_mask, mode)
    kl = aggregate(kl_estimate(rollout, old, "k3"), loss_mask, mode)
    return {"train/rollout_logprob_abs_diff": abs_diff.item(), "train/rollout_kl": kl.item()}


def correction_metrics(
    mode: str,
    weights: torch.Tensor,
    flags: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    aggregation: str,
) -> dict[str, float]:
    """`train/tis_mean` (mean applied weight) and `train/tis_clipfrac` (tis) or `train/mis_reject_frac`."""
    per_token = metric_aggregation(aggregation)
    metrics = {"train/tis_mean": aggregate(weights, loss_mask, per_token).item()}
    share = aggregate(flags.to(weights.dtype), loss_mask, per_token).item()
    metrics["train/tis_clipfrac" if mode == "tis" else "train/mis_reject_frac"] = share
    return metrics
