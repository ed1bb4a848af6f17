"""The importance-weighted KL estimate (DeepSeek-V3.2) against float64 loop references: value and gradient."""

from __future__ import annotations

import math

import pytest
import torch

from verst.algo import importance_weighted_kl, rl_loss
from verst.config.schema import AlgorithmConfig

MASK = torch.tensor([[1, 1, 1, 0], [1, 0, 1, 1], [0, 0, 0, 0]], dtype=torch.float64)


def draws(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(MASK.shape, generator=gen, dtype=torch.float64) * 3
    logp = old + 0.3 * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    ref = old + 0.5 * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    return logp, old, ref


def ref_unbiased_k3(logp: float, old: float, ref: float) -> float:
    """DeepSeek-V3.2 eq. 7: (π/π_old)·(π_ref/π − log(π_ref/π) − 1)."""
    p, p_old, p_ref = math.exp(logp), math.exp(old), math.exp(ref)
    return p / p_old * (p_ref / p - math.log(p_ref / p) - 1)


def test_value_matches_the_reports_definition():
    logp, old, ref = draws(0)
    got = importance_weighted_kl(logp, old, ref, "k3")
    for i in range(3):
        for t in range(4):
            want = ref_unbiased_k3(logp[i, t].item(), old[i, t].item(), ref[i, t].item())
            assert got[i, t].item() == pytest.approx(want, rel=1e-12)


def test_gradient_is_the_ratio_times_the_log_ratio_to_the_reference():
    """d/d log π of ρ·k3 is ρ·(log π − log π_ref): the sampled gradient of KL(π ‖ π_ref) under π_old."""
    logp, old, ref = draws(1)
    logp.requires_grad_(True)
    importance_weighted_kl(logp, old, ref, "k3").sum().backward()
    for i in range(3):
        for t in range(4):
            lp, o, r = logp[i, t].item(), old[i, t].item(), ref[i, t].item()
            assert logp.grad[i, t].item() == pytest.approx(math.exp(lp - o) * (lp - r), rel=1e-10, abs=1e-14)


def test_kl_importance_weighted_replaces_the_kl_term_of_the_loss():
    logp, old, ref = draws(2)
    logp.requires_grad_(True)
    zero_adv = torch.zeros_like(MASK)
    cfg = AlgorithmConfig(kl_loss_coef=0.5, kl_importance_weighted=True)
    loss, metrics = rl_loss(cfg, logp, old, zero_adv, MASK, ref_logprobs=ref)
    terms = [ref_unbiased_k3(logp[i, t].item(), old[i, t].item(), ref[i, t].item())
             for i in range(3) for t in range(4) if MASK[i, t]]  # fmt: skip
    assert metrics["train/kl"] == pytest.approx(sum(terms) / len(terms), rel=1e-12)
    assert loss.item() == pytest.approx(0.5 * sum(terms) / len(terms), rel=1e-12)


def test_on_policy_the_weighted_and_plain_estimates_agree_in_value():
    logp, _, ref = draws(3)
    plain = rl_loss(AlgorithmConfig(kl_loss_coef=1.0), logp, logp, torch.zeros_like(MASK), MASK, ref_logprobs=ref)[0]
    weighted = rl_loss(AlgorithmConfig(kl_loss_coef=1.0, kl_importance_weighted=True), logp, logp,
                       torch.zeros_like(MASK), MASK, ref_logprobs=ref)[0]  # fmt: skip
    assert weighted.item() == pytest.approx(plain.item(), rel=1e-12)


def test_the_option_without_a_kl_loss_is_refused():
    from verst.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="kl_importance_weighted = true .*kl_loss_coef > 0"):
        load_config(None, ["--algorithm.kl-importance-weighted", "true"])
