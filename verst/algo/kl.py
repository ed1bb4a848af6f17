"""Per-token KL estimators k1, k2, k3 and low_var_kl between the policy and a base policy, and their
importance-weighted form for samples drawn from an older policy.

Schulman, "Approximating KL Divergence" (2020, http://joschu.net/blog/kl-approx.html).
"""

from __future__ import annotations

from typing import get_args

import torch

from verst.algo.aggregation import LOG_RATIO_CLAMP
from verst.config.training import KLEstimator

KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

# low_var_kl bounds the k3 value, so one wild token cannot dominate the loss.
LOW_VAR_KL_BOUND = 10.0


def kl_estimate(logprobs: torch.Tensor, base_logprobs: torch.Tensor, estimator: str) -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_base) on tokens sampled from π; same shape as the inputs.

    With log r = log π_base(y_t) − log π(y_t):
    - k1 = −log r                (unbiased, high variance, can be negative)
    - k2 = ½ (log r)²            (biased, low variance)
    - k3 = (r − 1) − log r       (unbiased, ≥ 0, low variance)
    - low_var_kl = k3 clamped to [−10, 10]
    log r is clamped to ±LOG_RATIO_CLAMP before exp in k3 / low_var_kl, so extreme tokens stay finite.
    Gradients flow through `logprobs` (the KL-loss convention of GRPO, Shao et al. 2024,
    arXiv:2402.03300, whose KL term is k3); `base_logprobs` is treated as a constant.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator {estimator!r} is unknown; expected one of {KL_ESTIMATORS}")
    log_r = base_logprobs.detach() - logprobs  # [batch, resp_len]
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    log_r = log_r.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    k3 = torch.exp(log_r) - 1.0 - log_r
    if estimator == "k3":
        return k3
    return k3.clamp(-LOW_VAR_KL_BOUND, LOW_VAR_KL_BOUND)


def importance_weighted_kl(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token KL(π ‖ π_ref) estimate on tokens sampled from π_old, weighted by the importance ratio.

    (π(y_t)/π_old(y_t))·kl_t with kl_t = `kl_estimate(logprobs, ref_logprobs, estimator)`; with k3 this is
    the unbiased KL estimate of the DeepSeek-V3.2 report (DeepSeek-AI 2025, arXiv:2512.02556, §3.1,
    eq. 7). The samples come from π_old, not π: the ratio makes both the value and, because gradients
    flow through the ratio as well, the gradient unbiased: for k3 the gradient with respect to
    log π(y_t) is ρ_t·(log π(y_t) − log π_ref(y_t)), the true KL gradient's sample. The log-ratio
    is clamped to ±LOG_RATIO_CLAMP before exp.
    """
    ratio = torch.exp((logprobs - old_logprobs.detach()).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    return ratio * kl_estimate(logprobs, ref_logprobs, estimator)
