"""The combined RL loss composed per `AlgorithmConfig` (with on-policy distillation as an advantage term), and SFT.

Everything returns `(loss, metrics)`; metrics are python floats, local means (see `aggregation`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verst.algo.advantages import distill_advantages
from verst.algo.aggregation import aggregate, check_token_shapes, metric_aggregation, to_global_share
from verst.algo.kl import importance_weighted_kl, kl_estimate
from verst.algo.mismatch import correction_metrics, mismatch_metrics, opsm_keep, stale_token_keep, staleness_metrics
from verst.algo.plugins import LossPlugins, load_loss_plugins
from verst.algo.policy_loss import policy_metrics, value_loss
from verst.config.registries import MISMATCH_CORRECTIONS, NO_CORRECTION, POLICY_LOSSES
from verst.config.schema import AlgorithmConfig


def sft_loss(
    logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    aggregation: str = "token_mean",
    normalizer: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Masked negative log-likelihood of the target tokens -> (loss, `train/sft_loss`, `train/loss`)."""
    check_token_shapes(loss_mask, logprobs=logprobs)
    local = aggregate(-logprobs, loss_mask, aggregation)
    metrics = {"train/sft_loss": local.item(), "train/loss": local.item()}
    return to_global_share(local, loss_mask, aggregation, normalizer), metrics


def _check_needed(cfg: AlgorithmConfig, custom_mismatch: bool, **given: torch.Tensor | None) -> None:
    needs = {
        "ref_logprobs": ("kl_loss_coef", cfg.kl_loss_coef),
        "entropy": ("entropy_coef", cfg.entropy_coef),
        "teacher_logprobs": ("distill_coef", cfg.distill_coef),
    }
    for name, (field, coef) in needs.items():
        if coef > 0 and given[name] is None:
            raise ValueError(f"algorithm.{field} = {coef} needs {name}, which was not given")
    correction = (
        f"mismatch_fn = {cfg.mismatch_fn!r}"
        if custom_mismatch
        else f"mismatch_correction = {cfg.mismatch_correction!r}"
    )
    if custom_mismatch or cfg.mismatch_correction != NO_CORRECTION:
        if given["rollout_logprobs"] is None:
            raise ValueError(f"{correction} needs rollout_logprobs")
        if cfg.old_logprobs == "rollout":
            raise ValueError(
                f"{correction} with old_logprobs = 'rollout': the old policy "
                "is then the rollout policy and there is no mismatch to correct; turn one off"
            )
    if cfg.opsm_delta is not None and given["rollout_logprobs"] is None:
        raise ValueError(f"algorithm.opsm_delta = {cfg.opsm_delta} needs rollout_logprobs")
    if cfg.max_token_staleness is not None and given["token_staleness"] is None:
        raise ValueError(f"algorithm.max_token_staleness = {cfg.max_token_staleness} needs token_staleness "
                         "(the trainer's version minus each token's), which was not given")
    value_inputs = [given["values"], given["old_values"], given["returns"]]
    if any(v is not None for v in value_inputs) and any(v is None for v in value_inputs):
        raise ValueError("the value loss needs values, old_values and returns together; some were None")


def _token_weights(
    cfg: AlgorithmConfig,
    plugins: LossPlugins,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    token_staleness: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, dict[str, float]]:
    """The product of the mismatch weights, the OPSM mask and the stale-token mask on each token's policy loss
    (None: none is on), with the metrics of each, of the raw mismatch ratio and of the tokens' age."""
    mode = cfg.loss_aggregation
    metrics: dict[str, float] = {}
    weights = None
    if rollout_logprobs is not None:
        metrics |= mismatch_metrics(
            old_logprobs, rollout_logprobs, loss_mask, aggregation=mode, correction=cfg.mismatch_correction
        )
    if plugins.mismatch_fn is not None or cfg.mismatch_correction != NO_CORRECTION:
        correct = plugins.mismatch_fn or MISMATCH_CORRECTIONS.load(cfg.mismatch_correction)
        weights, flags = correct(old_logprobs.detach(), rollout_logprobs.detach(), loss_mask,
                                 clip_low=cfg.tis_clip_low, clip_high=cfg.tis_clip)
        which = "mismatch_fn" if plugins.mismatch_fn is not None else f"mismatch_correction {cfg.mismatch_correction!r}"
        check_token_shapes(loss_mask, **{f"{which} weights": weights, f"{which} flags": flags})
        weights = weights.detach().to(logprobs.dtype)
        metrics |= correction_metrics(cfg.mismatch_correction, weights, flags, loss_mask, aggregation=mode)
    if cfg.opsm_delta is not None:
        keep, dropped = opsm_keep(logprobs, rollout_logprobs, advantages, loss_mask, delta=cfg.opsm_delta)
        weights = keep if weights is None else weights * keep
        share = aggregate(dropped.to(logprobs.dtype), loss_mask, metric_aggregation(mode))
        metrics["train/opsm_masked_frac"] = share.item()
    if token_staleness is not None:
        metrics |= staleness_metrics(token_staleness, loss_mask, aggregation=mode)
    if cfg.max_token_staleness is not None:
        keep, rejected = stale_token_keep(token_staleness, loss_mask, max_staleness=cfg.max_token_staleness)
        keep = keep.to(logprobs.dtype)
        weights = keep if weights is None else weights * keep
        share = aggregate(rejected.to(logprobs.dtype), loss_mask, metric_aggregation(mode))
        metrics["train/stale_token_reject_frac"] = share.item()
    return weights, metrics


def _policy_term(
    cfg: AlgorithmConfig,
    plugins: LossPlugins,
    reduce: Callable[[torch.Tensor], torch.Tensor],
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    rollout_logprobs: torch.Tensor | None,
    token_staleness: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The local-mean policy-gradient loss with its mismatch weights, OPSM and stale-token masks, and their
    metrics."""
    weights, metrics = _token_weights(cfg, plugins, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs,
                                      token_staleness)
    token_loss_fn = plugins.policy_loss_fn or POLICY_LOSSES.load(cfg.policy_loss)
    token_loss, clipped = token_loss_fn(logprobs, old_logprobs.detach(), advantages.detach(), loss_mask, cfg)
    which = "policy_loss_fn" if plugins.policy_loss_fn is not None else f"policy_loss {cfg.policy_loss!r}"
    check_token_shapes(loss_mask, **{f"{which} token_loss": token_loss, f"{which} clipped": clipped})
    if weights is not None:
        token_loss = token_loss * weights
    loss = reduce(token_loss)
    metrics |= policy_metrics(loss, clipped, logprobs, old_logprobs, loss_mask, aggregation=cfg.loss_aggregation)
    return loss, metrics


def rl_loss(
    cfg: AlgorithmConfig,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    rollout_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    old_values: torch.Tensor | None = None,
    returns: torch.Tensor | None = None,
    token_staleness: torch.Tensor | None = None,
    normalizer: float | None = None,
    plugins: LossPlugins | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The training loss of one (micro-)batch -> (loss, metrics); all per-token tensors [batch, resp_len].

    loss = pg + kl_loss_coef·KL(π ‖ π_ref) − entropy_coef·H [+ value loss]
    - advantages: the task's, times `cfg.reward_coef`; with `teacher_logprobs`, plus `cfg.distill_coef`
      times the teacher's minus the old policy's logprob per token (`distill_advantages`).
    - pg: `cfg.policy_loss` (PPO clip or GSPO, see `policy_loss`) or the `cfg.policy_loss_fn` plug-in,
      each token's loss multiplied by the train–inference mismatch weight of `cfg.mismatch_correction`
      or the `cfg.mismatch_fn` plug-in (see `mismatch`) and by the OPSM mask of `cfg.opsm_delta`
      (`opsm_keep`) and the stale-token mask of `cfg.max_token_staleness` over `token_staleness` (the
      trainer's version minus each token's, `stale_token_keep`), which change the numerator only: rejected
      tokens still count in the normaliser.
    - KL: `cfg.kl_estimator` of π vs `ref_logprobs`, weighted by π/π_old with
      `cfg.kl_importance_weighted` (`importance_weighted_kl`); H: the given per-token `entropy`.
    - value loss: added with weight 1 when `values`, `old_values`, `returns` are given (a shared value
      head); a separate critic calls `value_loss` itself.
    Every term is reduced by `cfg.loss_aggregation`, or by the `cfg.loss_reducer` plug-in. `plugins`
    are the loaded plug-ins (default: `load_loss_plugins(cfg)`). With `normalizer` (the global token or
    sequence count: `aggregation_normalizer` summed over all micro-batches and ranks) the loss is this
    micro-batch's share, so the micro-batch losses add up to the global-batch loss. Metrics are local
    means (per-token ones reduced by `metric_aggregation`; weight them by `aggregation_normalizer` to
    combine micro-batches; `*_max`/`*_min` combine by max/min). Metrics present only when their inputs
    are: `train/pg_loss`, `train/pg_clipfrac`, `train/ppo_kl`, `train/loss`, `train/kl`,
    `train/entropy`, `train/distill_kl`, `train/value_loss`, `train/value_clipfrac`,
    `train/opsm_masked_frac`, with `token_staleness` `train/token_staleness_mean`, `train/stale_token_frac` and
    `train/stale_token_reject_frac`, and with rollout logprobs `train/rollout_logprob_abs_diff`,
    `train/rollout_kl`, `train/mismatch_ratio_mean`, `_max`, `_min`, `train/ess_ratio`,
    `train/tis_mean`, `train/tis_clipfrac` or `train/mis_reject_frac`.
    """
    check_token_shapes(
        loss_mask, logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages,
        rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs, entropy=entropy,
        teacher_logprobs=teacher_logprobs, values=values, old_values=old_values, returns=returns,
        token_staleness=token_staleness,
    )  # fmt: skip
    plugins = load_loss_plugins(cfg) if plugins is None else plugins
    _check_needed(
        cfg, plugins.mismatch_fn is not None, rollout_logprobs=rollout_logprobs, ref_logprobs=ref_logprobs,
        entropy=entropy, teacher_logprobs=teacher_logprobs, values=values, old_values=old_values, returns=returns,
        token_staleness=token_staleness,
    )  # fmt: skip
    mode, per_token = cfg.loss_aggregation, metric_aggregation(cfg.loss_aggregation)
    reducer = plugins.loss_reducer or aggregate

    def reduce(token_values: torch.Tensor) -> torch.Tensor:
        return reducer(token_values, loss_mask, mode)

    def metric(token_values: torch.Tensor) -> float:
        return aggregate(token_values.detach(), loss_mask, per_token).item()

    if teacher_logprobs is not None:
        advantages = distill_advantages(advantages, old_logprobs, teacher_logprobs, loss_mask,
                                        reward_coef=cfg.reward_coef, distill_coef=cfg.distill_coef)
    elif cfg.reward_coef != 1.0:
        advantages = cfg.reward_coef * advantages
    loss, metrics = _policy_term(cfg, plugins, reduce, logprobs, old_logprobs, advantages, loss_mask, rollout_logprobs,
                                 token_staleness)
    if teacher_logprobs is not None:
        metrics["train/distill_kl"] = metric(logprobs - teacher_logprobs)
    if ref_logprobs is not None:
        if cfg.kl_importance_weighted:
            kl = importance_weighted_kl(logprobs, old_logprobs, ref_logprobs, cfg.kl_estimator)
        else:
            kl = kl_estimate(logprobs, ref_logprobs, cfg.kl_estimator)
        metrics["train/kl"] = metric(kl)
        if cfg.kl_loss_coef > 0:
            loss = loss + cfg.kl_loss_coef * reduce(kl)
    if entropy is not None:
        metrics["train/entropy"] = metric(entropy)
        if cfg.entropy_coef > 0:
            loss = loss - cfg.entropy_coef * reduce(entropy)
    if values is not None:
        v_loss, v_metrics = value_loss(
            values, old_values, returns, loss_mask, value_clip=cfg.value_clip, aggregation=mode, reducer=reducer
        )
        loss = loss + v_loss
        metrics |= v_metrics
    metrics["train/loss"] = loss.item()
    return to_global_share(loss, loss_mask, mode, normalizer), metrics
