"""Pure RL math over tensors: advantage estimators and losses returning `(loss, metrics)`.

Layer 1: imports only torch and `verst.config`. Tensor and micro-batching conventions: `aggregation`.
"""

from verst.algo.advantages import (
    batch_whiten,
    broadcast_to_tokens,
    compute_advantages,
    discounted_returns,
    distill_advantages,
    gae,
    group_relative_rewards,
    reinforce_plus_plus,
    rloo_rewards,
)
from verst.algo.aggregation import (
    AGGREGATIONS,
    aggregate,
    aggregation_normalizer,
    metric_aggregation,
    to_global_share,
)
from verst.algo.kl import KL_ESTIMATORS, importance_weighted_kl, kl_estimate
from verst.algo.losses import rl_loss, sft_loss
from verst.algo.mismatch import (
    ess_ratio,
    ess_ratio_from_moments,
    mismatch_log_ratio,
    mismatch_metrics,
    mismatch_weights,
    opsm_keep,
    stale_token_keep,
    staleness_metrics,
)
from verst.algo.plugins import LossPlugins, LossReducer, MismatchFn, PolicyLossFn, load_loss_plugins
from verst.algo.policy_loss import (
    clipped_surrogate,
    explained_variance,
    gspo_log_ratio,
    gspo_token_loss,
    policy_loss,
    ppo_clip_token_loss,
    value_loss,
)
from verst.config.registries import ADVANTAGE_ESTIMATORS, MISMATCH_CORRECTIONS, POLICY_LOSSES

# Your own, by name: `@register_advantage_estimator("name")` over `fn(cfg, rewards, group_ids, loss_mask, *, kl,
# values) -> (advantages, returns | None)`, `@register_policy_loss("name")` over a `PolicyLossFn`,
# `@register_mismatch_correction("name")` over a `MismatchFn`, in a module that the config's `plugins` lists.
register_advantage_estimator = ADVANTAGE_ESTIMATORS.register
register_policy_loss = POLICY_LOSSES.register
register_mismatch_correction = MISMATCH_CORRECTIONS.register

__all__ = [
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "LossPlugins",
    "LossReducer",
    "MismatchFn",
    "PolicyLossFn",
    "aggregate",
    "aggregation_normalizer",
    "batch_whiten",
    "broadcast_to_tokens",
    "clipped_surrogate",
    "compute_advantages",
    "discounted_returns",
    "distill_advantages",
    "ess_ratio",
    "ess_ratio_from_moments",
    "explained_variance",
    "gae",
    "group_relative_rewards",
    "gspo_log_ratio",
    "importance_weighted_kl",
    "kl_estimate",
    "load_loss_plugins",
    "metric_aggregation",
    "mismatch_log_ratio",
    "mismatch_metrics",
    "mismatch_weights",
    "opsm_keep",
    "policy_loss",
    "gspo_token_loss",
    "ppo_clip_token_loss",
    "register_advantage_estimator",
    "register_mismatch_correction",
    "register_policy_loss",
    "reinforce_plus_plus",
    "rl_loss",
    "rloo_rewards",
    "sft_loss",
    "stale_token_keep",
    "staleness_metrics",
    "to_global_share",
    "value_loss",
]
