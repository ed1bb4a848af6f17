"""Clipped surrogate losses: PPO (clip-higher, dual clip), GSPO, the clipped value loss and its diagnostic.

Each has a per-token form (for composing) and a `(loss, metrics)` form (aggregated, see `aggregation`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verst.algo.aggregation import (
    LOG_RATIO_CLAMP,
    aggregate,
    check_token_shapes,
    masked_sequence_mean,
    metric_aggregation,
    to_global_share,
)
from verst.config.registries import POLICY_LOSSES
from verst.config.schema import AlgorithmConfig


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    *,
    eps_clip: float,
    eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO clipped loss -> (loss [batch, resp_len], clipped [batch, resp_len] bool).

    PPO (Schulman et al. 2017, arXiv:1707.06347, eq. 7) as a loss:
    max(−A·ρ, −A·clip(ρ, 1−ε_low, 1+ε_high)) with ρ = exp(log_ratio). Clip-higher (DAPO, Yu et al.
    2025, arXiv:2503.14476): ε_high (`eps_clip_high`, default ε_low = `eps_clip`) may exceed ε_low.
    Dual clip (Ye et al. 2020, arXiv:1912.09729): for A < 0 the loss is also capped at −c·A.
    `clipped` marks tokens whose loss came from a clipped branch; they carry no gradient.
    log_ratio is clamped to ±LOG_RATIO_CLAMP before exp (finite values and gradients).
    """
    eps_high = eps_clip if eps_clip_high is None else eps_clip_high
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped = -advantages * ratio
    clipped_loss = -advantages * ratio.clamp(1.0 - eps_clip, 1.0 + eps_high)
    clipped = clipped_loss > unclipped
    # where() instead of max(): the selected branch alone carries the gradient, even at ties.
    loss = torch.where(clipped, clipped_loss, unclipped)
    if dual_clip_c is not None:
        if not dual_clip_c > 1.0:
            raise ValueError(f"dual_clip_c must be > 1; got {dual_clip_c}")
        cap = -advantages * dual_clip_c
        dual = (advantages < 0) & (loss > cap)
        loss = torch.where(dual, cap, loss)
        clipped = clipped | dual
    return loss, clipped


def gspo_log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """GSPO-token log-ratio [batch, resp_len] (Zheng et al. 2025, arXiv:2507.18071, GSPO and GSPO-token).

    Value: log s_i = (1/|y_i|) Σ_t (log π(y_t) − log π_old(y_t)), the sequence-level log-ratio, on
    every token of sequence i. Gradient: that of log π(y_t) alone, i.e. s_{i,t} = sg[s_i]·π(y_t)/sg[π(y_t)].
    With one advantage per sequence and `seq_mean_token_mean` this gives exactly GSPO's gradient.
    """
    seq_log_ratio = masked_sequence_mean(logprobs.detach() - old_logprobs, loss_mask)  # [batch]
    return seq_log_ratio.detach()[:, None] + (logprobs - logprobs.detach())


def ppo_kl(logprobs: torch.Tensor, old_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token k1 estimate of KL(π_old ‖ π) on tokens from π_old: log π_old − log π (a metric)."""
    return (old_logprobs - logprobs).detach()


def policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    kind: str = "ppo_clip",
    eps_clip: float = 0.2,
    eps_clip_high: float | None = None,
    dual_clip_c: float | None = None,
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO-clip (`kind="ppo_clip"`) or GSPO (`kind="gspo"`) policy loss -> (loss, metrics).

    `weights [batch, resp_len]` (no gradient) multiply each token's loss, e.g. train–inference
    mismatch weights; they change the numerator only, the normaliser still counts every policy token.

    Metrics (local means, see `aggregation`): `train/pg_loss`, `train/pg_clipfrac` (share of tokens
    in a clipped branch), `train/ppo_kl`; the last two reduce by `metric_aggregation`.
    """
    check_token_shapes(loss_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages)
    cfg = AlgorithmConfig(policy_loss=kind, eps_clip=eps_clip, eps_clip_high=eps_clip_high, dual_clip_c=dual_clip_c)
    token_loss, clipped = POLICY_LOSSES.load(kind)(logprobs, old_logprobs, advantages, loss_mask, cfg)
    if weights is not None:
        check_token_shapes(loss_mask, weights=weights)
        token_loss = token_loss * weights.detach()
    local = aggregate(token_loss, loss_mask, aggregation)
    metrics = policy_metrics(local, clipped, logprobs, old_logprobs, loss_mask, aggregation=aggregation)
    return to_global_share(local, loss_mask, aggregation, normalizer), metrics


def policy_metrics(
    local_loss: torch.Tensor,
    clipped: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    aggregation: str,
) -> dict[str, float]:
    """`train/pg_loss` (the local loss), `train/pg_clipfrac` and `train/ppo_kl` (by `metric_aggregation`)."""
    per_token = metric_aggregation(aggregation)
    return {
        "train/pg_loss": local_loss.item(),
        "train/pg_clipfrac": aggregate(clipped.to(logprobs.dtype), loss_mask, per_token).item(),
        "train/ppo_kl": aggregate(ppo_kl(logprobs, old_logprobs), loss_mask, per_token).item(),
    }


# ---- the registered per-token losses: `fn(logprobs, old_logprobs, advantages, loss_mask, cfg) -> (loss, clipped)`
def ppo_clip_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                        loss_mask: torch.Tensor, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped surrogate on each token's ratio π/π_old (clip-higher and dual clip from `cfg`)."""
    return clipped_surrogate(logprobs - old_logprobs.detach(), advantages.detach(), eps_clip=cfg.eps_clip,
                             eps_clip_high=cfg.eps_clip_high, dual_clip_c=cfg.dual_clip_c)


def gspo_token_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                    loss_mask: torch.Tensor, cfg: AlgorithmConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """GSPO: the clipped surrogate on the sequence's length-normalised ratio, on every token of it."""
    return clipped_surrogate(gspo_log_ratio(logprobs, old_logprobs.detach(), loss_mask), advantages.detach(),
                             eps_clip=cfg.eps_clip, eps_clip_high=cfg.eps_clip_high, dual_clip_c=cfg.dual_clip_c)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    value_clip: float,
    aggregation: str = "token_mean",
    normalizer: float | None = None,
    reducer: Callable[[torch.Tensor, torch.Tensor, str], torch.Tensor] = aggregate,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss -> (loss, local-mean metrics `train/value_loss`, `train/value_clipfrac`).

    ½·max((V − R)², (V_old + clip(V − V_old, −c, c) − R)²) per token (PPO as in OpenAI baselines'
    ppo2; Schulman et al. 2017, arXiv:1707.06347, eq. 9 with clipping of the value update), reduced by
    `reducer` (default `aggregate`; a `LossReducer` plug-in).
    """
    check_token_shapes(loss_mask, values=values, old_values=old_values, returns=returns)
    old_values, returns = old_values.detach(), returns.detach()
    clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
    unclipped_err = (values - returns).square()
    clipped_err = (clipped_values - returns).square()
    clipped = clipped_err > unclipped_err
    token_loss = 0.5 * torch.where(clipped, clipped_err, unclipped_err)
    local = reducer(token_loss, loss_mask, aggregation)
    clipfrac = aggregate(clipped.to(token_loss.dtype), loss_mask, metric_aggregation(aggregation))
    metrics = {"train/value_loss": local.item(), "train/value_clipfrac": clipfrac.item()}
    return to_global_share(local, loss_mask, aggregation, normalizer), metrics


@torch.no_grad()
def explained_variance(values: torch.Tensor, returns: torch.Tensor, loss_mask: torch.Tensor) -> float | None:
    """1 − Var[R − V] / Var[R] over the policy tokens (population variances): 1 when the critic predicts
    the returns exactly, 0 when it does no better than their mean, negative when worse (the diagnostic
    of OpenAI baselines' PPO). None when the returns do not vary (the ratio is undefined).
    """
    check_token_shapes(loss_mask, values=values, returns=returns)
    mask = loss_mask != 0
    target = returns[mask].double()
    residual = target - values[mask].double()
    variance = target.var(unbiased=False) if target.numel() else target.new_zeros(())
    if not float(variance) > 0:
        return None
    return float(1.0 - residual.var(unbiased=False) / variance)
