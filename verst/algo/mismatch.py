"""Train–inference mismatch: weights on the policy loss from rollout vs trainer old logprobs, their
raw-ratio and effective-sample-size metrics, and off-policy sequence masking (OPSM).

The engine's sampling policy π_rollout and the trainer's π_old differ numerically (kernels, precision);
ρ_t = π_old(y_t) / π_rollout(y_t) corrects for it (decoupled, three-policy PPO).
"""

from __future__ import annotations

import math

import torch

from verst.algo.aggregation import (
    aggregate,
    check_token_shapes,
    clamped_exp,
    masked_sequence_mean,
    metric_aggregation,
)
from verst.algo.kl import kl_estimate
from verst.config.registries import MISMATCH_CORRECTIONS, NO_CORRECTION

RATIOS = ("token", "sequence", "geometric")  # what a correction tests (`CorrectionEntry.ratio`)


def mismatch_log_ratio(
    ratio: str, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor
) -> torch.Tensor:
    """The log-ratio [batch, resp_len] a correction clips or tests (no gradient, 0 on masked tokens).

    log ρ_t = log π_old(y_t) − log π_rollout(y_t) per token (`token`); for `sequence` the sequence's
    Σ_t log ρ_t, for `geometric` its mean over policy tokens, on every token of the sequence.
    """
    if ratio not in RATIOS:
        raise ValueError(f"mismatch ratio {ratio!r} is not one of {RATIOS}")
    check_token_shapes(loss_mask, old_logprobs=old_logprobs, rollout_logprobs=rollout_logprobs)
    mask = loss_mask != 0
    log_rho = torch.where(mask, old_logprobs.detach() - rollout_logprobs.detach(), 0.0)  # [batch, resp_len]
    if ratio == "sequence":
        log_rho = log_rho.sum(dim=-1, keepdim=True).expand_as(log_rho)
    elif ratio == "geometric":
        log_rho = masked_sequence_mean(log_rho, loss_mask)[:, None].expand_as(log_rho)
    return torch.where(mask, log_rho, 0.0)


def mismatch_weights(
    mode: str,
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token weights on the policy loss and the tokens they clip or reject, both [batch, resp_len], of
    the registered correction `mode` (`verst.config.registries.MISMATCH_CORRECTIONS`). Weights carry no
    gradient; the band test is done on log ρ, so extreme ratios are rejected exactly and weights stay finite."""
    if not 0.0 <= clip_low < clip_high:
        raise ValueError(f"need 0 <= tis_clip_low < tis_clip; got tis_clip_low={clip_low}, tis_clip={clip_high}")
    return MISMATCH_CORRECTIONS.load(mode)(old_logprobs, rollout_logprobs, loss_mask, clip_low=clip_low,
                                           clip_high=clip_high)


def _band(ratio: str, old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor,
          clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ρ of `ratio` (exp of `mismatch_log_ratio`, clamped) and the tokens outside [clip_low, clip_high]."""
    log_rho = mismatch_log_ratio(ratio, old_logprobs, rollout_logprobs, loss_mask)
    log_low = math.log(clip_low) if clip_low > 0 else -math.inf
    outside = (log_rho < log_low) | (log_rho > math.log(clip_high))
    return clamped_exp(log_rho), outside


def _masked(rho: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
    """ρ inside the band, 0 outside."""
    return rho * torch.where(outside, 0.0, 1.0).to(rho.dtype)


# ---- the registered corrections: `fn(old, rollout, mask, *, clip_low, clip_high) -> (weights, flags)` -----
def tis_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                   clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w_t = clip(ρ_t, low, high): truncated importance sampling (Yao et al. 2025, "Your Efficient RL Framework
    Secretly Brings You Off-Policy RL Training"); the flags mark the clipped tokens."""
    rho, outside = _band("token", old_logprobs, rollout_logprobs, loss_mask, clip_low, clip_high)
    return rho.clamp(clip_low, clip_high), outside


def mis_token_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                         clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """w_t = ρ_t inside the band, 0 outside: masked importance sampling (Liu et al. 2025, "When Speed Kills
    Stability"). It is also IcePop's M(ρ_t) = ρ_t on [α, β], 0 elsewhere (Ring-1T report, inclusionAI 2025)."""
    rho, outside = _band("token", old_logprobs, rollout_logprobs, loss_mask, clip_low, clip_high)
    return _masked(rho, outside), outside


icepop_correction = mis_token_correction


def mis_sequence_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                            clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`mis_token`'s test and weight with the sequence ratio ρ = Π_t ρ_t."""
    rho, outside = _band("sequence", old_logprobs, rollout_logprobs, loss_mask, clip_low, clip_high)
    return _masked(rho, outside), outside


def mis_geometric_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                             clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`mis_token`'s test and weight with the geometric mean ρ = exp(mean_t log ρ_t): a length-independent band."""
    rho, outside = _band("geometric", old_logprobs, rollout_logprobs, loss_mask, clip_low, clip_high)
    return _masked(rho, outside), outside


def band_mask_correction(old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, loss_mask: torch.Tensor, *,
                         clip_low: float, clip_high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The token band as a plain 0/1 mask (1 inside, 0 outside), no reweighting."""
    rho, outside = _band("token", old_logprobs, rollout_logprobs, loss_mask, clip_low, clip_high)
    return torch.where(outside, 0.0, 1.0).to(rho.dtype), outside


def ess_ratio(weights: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Effective sample size over sample count of importance weights: (Σ w)² / (N · Σ w²) over the N
    policy tokens (Kong 1992; Owen, "Monte Carlo theory, methods and examples", §9.3). 1 when every
    weight is equal, 1/N when one token carries all the weight; 0 without policy tokens."""
    check_token_shapes(loss_mask, weights=weights)
    w = weights.detach()[loss_mask != 0]  # [N]
    square_sum = w.square().sum()
    if not square_sum > 0:
        return torch.zeros((), dtype=weights.dtype, device=weights.device)
    return w.sum().square() / (w.numel() * square_sum)


def ess_ratio_from_moments(mean: float, square_mean: float) -> float:
    """`ess_ratio` from the weights' mean and mean square: mean² / square_mean, equal to (Σ w)² / (N · Σ w²).
    Both means add up over micro-batches (`train/mismatch_ratio_mean`, `train/mismatch_ratio_sq_mean`),
    so the ratio of the whole step's batch follows from the combined metrics; 0 for no weight. Capped
    at 1, its bound (Cauchy–Schwarz), which the rounding of float32 moments can overshoot by an ulp."""
    return min(1.0, mean * mean / square_mean) if square_mean > 0 else 0.0


def mismatch_metrics(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    aggregation: str,
    correction: str = NO_CORRECTION,
) -> dict[str, float]:
    """Local metrics of the mismatch (means by `metric_aggregation`):
    - `train/rollout_logprob_abs_diff`: |log π_old − log π_rollout|;
    - `train/rollout_kl`: k3 estimate of KL(π_rollout ‖ π_old) on the rollout's tokens;
    - `train/mismatch_ratio_mean`, `_max`, `_min`: the raw ratio ρ that `correction` tests (see
      its registry entry's `ratio`; token ρ_t for `none`), before any clipping or masking; max and min
      only where there are policy tokens;
    - `train/mismatch_ratio_sq_mean`: the mean of ρ², from which `ess_ratio_from_moments` gives the
      effective sample size ratio of the combined micro-batches (`train/ess_ratio`, logged per step).
    """
    old, rollout = old_logprobs.detach(), rollout_logprobs.detach()
    mode = metric_aggregation(aggregation)
    abs_diff = aggregate((old - rollout).abs(), loss_mask, mode)
    kl = aggregate(kl_estimate(rollout, old, "k3"), loss_mask, mode)
    ratio = "token" if correction == NO_CORRECTION else MISMATCH_CORRECTIONS.entry(correction).ratio
    rho = clamped_exp(mismatch_log_ratio(ratio, old, rollout, loss_mask))
    metrics = {
        "train/rollout_logprob_abs_diff": abs_diff.item(),
        "train/rollout_kl": kl.item(),
        "train/mismatch_ratio_mean": aggregate(rho, loss_mask, mode).item(),
        "train/mismatch_ratio_sq_mean": aggregate(rho.square(), loss_mask, mode).item(),
    }
    policy = rho[loss_mask != 0]
    if policy.numel():
        metrics |= {"train/mismatch_ratio_max": policy.max().item(), "train/mismatch_ratio_min": policy.min().item()}
    return metrics


def correction_metrics(
    mode: str,
    weights: torch.Tensor,
    flags: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    aggregation: str,
) -> dict[str, float]:
    """`train/tis_mean` (mean applied weight) and the share of flagged tokens, under the correction's
    `flags_metric` (`train/tis_clipfrac` for tis; `train/mis_reject_frac` for the others and a `mismatch_fn`)."""
    per_token = metric_aggregation(aggregation)
    metrics = {"train/tis_mean": aggregate(weights, loss_mask, per_token).item()}
    share = aggregate(flags.to(weights.dtype), loss_mask, per_token).item()
    name = "train/mis_reject_frac" if mode == NO_CORRECTION else MISMATCH_CORRECTIONS.entry(mode).flags_metric
    metrics[name] = share
    return metrics


def opsm_keep(
    logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    delta: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Off-policy sequence masking -> (keep [batch, resp_len] 0/1 float, dropped [batch, resp_len] bool).

    DeepSeek-V3.2 report (DeepSeek-AI 2025, arXiv:2512.02556, §3.1): token t of sequence i is dropped
    when Â_{i,t} < 0 and the sequence's KL(π_rollout ‖ π_θ), estimated as the mean over its policy
    tokens of log π_rollout(y_t) − log π_θ(y_t), exceeds `delta`. π_θ is the policy being trained
    (`logprobs`, detached) and π_rollout the sampling policy, so the KL covers both the
    train–inference gap and the policy's drift since sampling. Positive-advantage tokens are kept:
    learning from one's own successes needs no guard, while negative samples far off policy mislead.
    """
    check_token_shapes(loss_mask, logprobs=logprobs, rollout_logprobs=rollout_logprobs, advantages=advantages)
    if not delta >= 0:
        raise ValueError(f"opsm_delta must be >= 0; got {delta}")
    seq_kl = masked_sequence_mean(rollout_logprobs.detach() - logprobs.detach(), loss_mask)  # [batch]
    dropped = (advantages.detach() < 0) & (seq_kl > delta)[:, None] & (loss_mask != 0)
    return torch.where(dropped, 0.0, 1.0).to(logprobs.dtype), dropped


def stale_token_keep(
    token_staleness: torch.Tensor, loss_mask: torch.Tensor, *, max_staleness: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token rejection of old weights' samples -> (keep [batch, resp_len] 0/1 float, rejected [batch, resp_len]
    bool). `token_staleness` is the trainer's version minus the version that sampled each token (a partial
    rollout's response spans several); policy tokens more than `max_staleness` versions old are rejected, so
    the tokens an update left behind drop out while the same response's fresh continuation still trains."""
    check_token_shapes(loss_mask, token_staleness=token_staleness)
    if max_staleness < 0:
        raise ValueError(f"max_token_staleness must be >= 0; got {max_staleness}")
    rejected = (token_staleness > max_staleness) & (loss_mask != 0)
    return torch.where(rejected, 0.0, 1.0).to(torch.float32), rejected


def staleness_metrics(token_staleness: torch.Tensor, loss_mask: torch.Tensor, *, aggregation: str) -> dict[str, float]:
    """Local metrics of the policy tokens' age (means by `metric_aggregation`): `train/token_staleness_mean`
    (versions between the weights that sampled a token and the trainer's) and `train/stale_token_frac` (the
    share sampled by weights older than the trainer's)."""
    check_token_shapes(loss_mask, token_staleness=token_staleness)
    mode = metric_aggregation(aggregation)
    age = token_staleness.detach().to(torch.float32)
    return {
        "train/token_staleness_mean": aggregate(age, loss_mask, mode).item(),
        "train/stale_token_frac": aggregate((age > 0).to(torch.float32), loss_mask, mode).item(),
    }
