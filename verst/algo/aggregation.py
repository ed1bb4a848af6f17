"""Reduce per-token values to one number, and rescale it to a caller-given global normaliser.

Shape checks and the log-ratio clamp shared by every loss live here too.

Tensor conventions of the whole `verst.algo` package:
- per-token tensors are padded, response-aligned `[batch, resp_len]` floats;
- `loss_mask [batch, resp_len]` is 1 on policy tokens and 0 on padding and environment/tool tokens
  (any nonzero value counts as 1); values at masked positions never enter a result (keep them
  finite all the same: a NaN there still turns its gradient into NaN);
- per-sample tensors (rewards, group ids) are `[batch]`.

Micro-batching. Losses take an optional `normalizer`: the global count of the aggregation's units
(policy tokens, or sequences), i.e. `aggregation_normalizer(mode, mask)` summed over the whole global
batch (all micro-batches, all ranks). With it, a loss is this micro-batch's share of the global
loss, `local_mean × local_count / normalizer`, so the micro-batch losses add up exactly to the
global-batch loss; without it, a loss is the local mean. Metrics are always local means; the global
value of a metric is the average of the micro-batch values weighted by their `aggregation_normalizer`
counts. Sequences must not be split across micro-batches (the per-sequence modes and GSPO need a
whole sequence). A backend that averages gradients over ranks (DDP/FSDP all-reduce mean) must
multiply the loss by the world size to keep that sum.
"""

from __future__ import annotations

from typing import get_args

import torch

from verst.config.training import LossAggregation

AGGREGATIONS: tuple[str, ...] = get_args(LossAggregation)

# exp() of a float32 above ~88 is inf, and inf times a zero gradient is NaN in backward. Every
# log-ratio is clamped to ±20 (ratio ~4.9e8) before exp; beyond that the clip has long taken over.
LOG_RATIO_CLAMP = 20.0


def check_token_shapes(loss_mask: torch.Tensor, **tensors: torch.Tensor | None) -> None:
    """Raise unless every given per-token tensor has the shape of `loss_mask` ([batch, resp_len])."""
    if loss_mask.dim() != 2:
        raise ValueError(f"loss_mask must be [batch, resp_len]; got shape {tuple(loss_mask.shape)}")
    for name, tensor in tensors.items():
        if tensor is not None and tensor.shape != loss_mask.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)} but loss_mask has {tuple(loss_mask.shape)}; "
                "per-token tensors must be response-aligned [batch, resp_len]"
            )


def clamped_exp(log_ratio: torch.Tensor) -> torch.Tensor:
    """exp of a log-ratio clamped to ±LOG_RATIO_CLAMP (finite in float32, finite gradients)."""
    return torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def aggregation_normalizer(mode: str, loss_mask: torch.Tensor) -> float:
    """This batch's share of the global normaliser; sum it over all micro-batches and ranks.

    `token_mean`: number of policy tokens. `seq_mean_*`: number of sequences with at least one
    policy token (a sequence made only of environment tokens carries no loss and is not counted).
    """
    _check_mode(mode)
    mask = loss_mask != 0  # [batch, resp_len]
    if mode == "token_mean":
        return float(mask.sum().item())
    return float((mask.sum(dim=-1) > 0).sum().item())


def aggregate(values: torch.Tensor, loss_mask: torch.Tensor, mode: str) -> torch.Tensor:
    """Local mean of per-token `values [batch, resp_len]` over policy tokens, by `mode`:

    - `token_mean`:          Σ_{i,t} v_it m_it / N,              N = #policy tokens
    - `seq_mean_token_mean`: Σ_i (Σ_t v_it m_it / Σ_t m_it) / N, N = #sequences (GRPO, GSPO)
    - `seq_mean_token_sum`:  Σ_i Σ_t v_it m_it / N,              N = #sequences (Dr.GRPO, Liu et al.
      2025, arXiv:2503.20783, which drops the per-sequence length division)
    N counts this batch only (`to_global_share` rescales to a global N); a batch without policy
    tokens reduces to 0.
    """
    _check_mode(mode)
    check_token_shapes(loss_mask, values=values)
    mask = loss_mask != 0  # [batch, resp_len]
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    tokens = mask.sum(dim=-1)  # [batch]
    if mode == "seq_mean_token_mean":
        numerator = (masked.sum(dim=-1) / tokens.clamp(min=1).to(values.dtype)).sum()
    else:
        numerator = masked.sum()
    count = tokens.sum() if mode == "token_mean" else (tokens > 0).sum()
    return numerator / count.clamp(min=1).to(values.dtype)


def metric_aggregation(mode: str) -> str:
    """How per-token metrics (fractions, KL, entropy) reduce under loss aggregation `mode`.

    `seq_mean_token_sum` would turn a fraction into a per-sequence count; its metrics use
    `seq_mean_token_mean` instead, which shares its count (sequences), so metrics of micro-batches
    still combine by weighting with `aggregation_normalizer`.
    """
    _check_mode(mode)
    return "seq_mean_token_mean" if mode == "seq_mean_token_sum" else mode


def to_global_share(
    local_loss: torch.Tensor, loss_mask: torch.Tensor, mode: str, normalizer: float | None
) -> torch.Tensor:
    """A local-mean loss -> this batch's share of the global loss: × local count / `normalizer`.

    Identity without a normaliser. Every term of one loss shares the aggregation's count, so a sum of
    local means is rescaled once.
    """
    if normalizer is None:
        return local_loss
    if not normalizer > 0:
        raise ValueError(f"normalizer must be positive (global token or sequence count); got {normalizer}")
    return local_loss * (aggregation_normalizer(mode, loss_mask) / normalizer)


def masked_sequence_mean(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence mean of `values [batch, resp_len]` over policy tokens -> [batch] (0 if none)."""
    mask = loss_mask != 0
    masked = torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1).to(values.dtype)


def _check_mode(mode: str) -> None:
    if mode not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {mode!r} is unknown; expected one of {AGGREGATIONS}")
