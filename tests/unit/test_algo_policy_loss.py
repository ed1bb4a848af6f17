"""Aggregation, PPO clip, GSPO, value loss, KL estimators, SFT and distillation vs float64 references."""

from __future__ import annotations

import math

import pytest
import torch

from verst.algo import (
    aggregate,
    aggregation_normalizer,
    distill_advantages,
    explained_variance,
    kl_estimate,
    policy_loss,
    sft_loss,
    to_global_share,
    value_loss,
)

MASK = torch.tensor(
    [
        [1, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0],  # length-1 response
        [1, 1, 0, 0, 1, 1],  # environment tokens in the middle
        [1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0],  # environment tokens only
    ],
    dtype=torch.float64,
)


def batch(seed: int, scale: float = 0.3):
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(MASK.shape, generator=gen, dtype=torch.float64) * 3
    logp = (old + scale * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(MASK.shape, generator=gen, dtype=torch.float64) * MASK
    return logp, old, adv


def ref_aggregate(values: list[list[float]], mask: list[list[float]], mode: str) -> float:
    """Plain loops over the definitions in `aggregate`'s docstring."""
    seqs = [i for i, row in enumerate(mask) if any(row)]
    if mode == "token_mean":
        total = sum(v for vr, mr in zip(values, mask) for v, m in zip(vr, mr) if m)
        return total / sum(1 for mr in mask for m in mr if m)
    sums = [sum(v for v, m in zip(values[i], mask[i]) if m) for i in seqs]
    if mode == "seq_mean_token_mean":
        sums = [s / sum(1 for m in mask[i] if m) for s, i in zip(sums, seqs)]
    return sum(sums) / len(seqs)


def ref_ppo_token(lp: float, old: float, a: float, el: float, eh: float, c: float | None) -> tuple[float, bool]:
    ratio = math.exp(lp - old)
    unclipped = -a * ratio
    clipped = -a * min(max(ratio, 1 - el), 1 + eh)
    loss, was_clipped = (clipped, True) if clipped > unclipped else (unclipped, False)
    if c is not None and a < 0 and loss > -a * c:
        loss, was_clipped = -a * c, True
    return loss, was_clipped


MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


@pytest.mark.parametrize("mode", MODES)
def test_aggregate_matches_reference_and_ignores_masked_garbage(mode):
    values = torch.randn(MASK.shape, dtype=torch.float64)
    garbage = torch.where(MASK == 0, torch.tensor(float("nan"), dtype=torch.float64), values)
    got = aggregate(garbage, MASK, mode)
    torch.testing.assert_close(got.item(), ref_aggregate(values.tolist(), MASK.tolist(), mode))
    expected_n = 15.0 if mode == "token_mean" else 4.0
    assert aggregation_normalizer(mode, MASK) == expected_n
    torch.testing.assert_close(to_global_share(got, MASK, mode, 2 * expected_n), got / 2)
    assert to_global_share(got, MASK, mode, None) is got


def test_aggregate_edge_cases_fail_or_reduce_loudly():
    assert aggregate(torch.ones(2, 3), torch.zeros(2, 3), "token_mean").item() == 0.0
    assert to_global_share(torch.tensor(0.0), torch.zeros(2, 3), "token_mean", 7.0).item() == 0.0
    with pytest.raises(ValueError, match="normalizer must be positive"):
        to_global_share(torch.tensor(1.0), torch.ones(2, 3), "token_mean", 0)
    with pytest.raises(ValueError, match="'sum' is unknown"):
        aggregate(torch.ones(2, 3), torch.ones(2, 3), "sum")
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\)"):
        aggregate(torch.ones(2, 4), torch.ones(2, 3), "token_mean")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("eh,c", [(0.2, None), (0.28, None), (0.28, 3.0)])
def test_ppo_clip_matches_reference(mode, eh, c):
    logp, old, adv = batch(0, scale=0.4)
    loss, metrics = policy_loss(
        logp, old, adv, MASK, kind="ppo_clip", eps_clip=0.2, eps_clip_high=eh, dual_clip_c=c, aggregation=mode
    )
    rows = [[ref_ppo_token(logp[i, t].item(), old[i, t].item(), adv[i, t].item(), 0.2, eh, c) for t in range(6)]
            for i in range(5)]  # fmt: skip
    mask = MASK.tolist()
    torch.testing.assert_close(loss.item(), ref_aggregate([[x[0] for x in r] for r in rows], mask, mode))
    # per-token metrics of seq_mean_token_sum are sequence means of token means (fractions stay fractions)
    metric_mode = "seq_mean_token_mean" if mode == "seq_mean_token_sum" else mode
    clipfrac = ref_aggregate([[float(x[1]) for x in r] for r in rows], mask, metric_mode)
    assert metrics["train/pg_clipfrac"] == pytest.approx(clipfrac) and 0 < clipfrac < 1
    ppo_kl = ref_aggregate((old - logp).tolist(), mask, metric_mode)
    assert metrics["train/ppo_kl"] == pytest.approx(ppo_kl)
    assert metrics["train/pg_loss"] == pytest.approx(loss.item())


def test_ppo_gradient_is_zero_exactly_on_clipped_tokens():
    logp, old, adv = batch(1, scale=0.5)
    loss, _ = policy_loss(logp, old, adv, MASK, eps_clip=0.2, eps_clip_high=0.28, dual_clip_c=3.0)
    loss.backward()
    n = MASK.sum().item()
    for i in range(5):
        for t in range(6):
            lp, o, a = logp[i, t].item(), old[i, t].item(), adv[i, t].item()
            _, was_clipped = ref_ppo_token(lp, o, a, 0.2, 0.28, 3.0)
            # d(−A·exp(lp − old))/d lp on free policy tokens; nothing elsewhere
            want = 0.0 if (not MASK[i, t] or was_clipped) else -a * math.exp(lp - o) / n
            assert logp.grad[i, t].item() == pytest.approx(want, abs=1e-12), (i, t)


@pytest.mark.parametrize("kind", ["ppo_clip", "gspo"])
@pytest.mark.parametrize("dual", [None, 3.0])
def test_extreme_log_ratios_stay_finite_and_clip_right(kind, dual):
    # each row is one sequence of length 1, so GSPO's sequence ratio equals the token ratio
    log_ratio = torch.tensor([[1e4], [-1e4], [1e4], [-1e4], [60.0], [-60.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0], [1.0], [-1.0], [-1.0], [2.0], [-2.0]], dtype=torch.float64)
    old = torch.full_like(log_ratio, -5.0)
    logp = (old + log_ratio).requires_grad_(True)
    mask = torch.ones_like(log_ratio)
    loss, metrics = policy_loss(logp, old, adv, mask, kind=kind, eps_clip=0.2, dual_clip_c=dual, aggregation="seq_mean_token_sum")
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    big = math.exp(20.0)  # the log-ratio clamp
    neg_big = 3.0 if dual else big
    per_row = [-1.2, 0.0, neg_big, 0.8, -2.4, 1.6]  # A>0 huge: -A(1+ε); A>0 tiny: ~0; A<0 huge: capped; A<0 tiny: -A(1-ε)
    want = sum(per_row) / 6
    assert loss.item() == pytest.approx(want, rel=1e-9, abs=1e-9)
    assert torch.equal(logp.grad, torch.zeros_like(logp.grad))  # all clipped or beyond the log-ratio clamp
    assert metrics["train/pg_clipfrac"] == pytest.approx((5 if dual else 4) / 6)


def ref_gspo_loss(logp: torch.Tensor, old: torch.Tensor, adv_seq: list[float], mask: list[list[float]], el, eh):
    """Sequence-level GSPO with autograd over scalar torch ops: mean_i max(−A s_i, −A clip(s_i))."""
    losses = []
    for i, row in enumerate(mask):
        positions = [t for t, m in enumerate(row) if m]
        if not positions:
            continue
        s = torch.exp(sum(logp[i, t] - old[i, t] for t in positions) / len(positions))
        a = adv_seq[i]
        losses.append(torch.maximum(-a * s, -a * torch.clamp(s, 1 - el, 1 + eh)))
    return sum(losses) / len(losses)


def test_gspo_matches_sequence_level_reference_value_and_gradient():
    logp, old, _ = batch(2, scale=0.15)
    adv_seq = [0.7, -1.3, 0.4, -0.2, 5.0]
    adv = torch.tensor([[a] * 6 for a in adv_seq], dtype=torch.float64) * MASK
    loss, metrics = policy_loss(logp, old, adv, MASK, kind="gspo", eps_clip=0.05, eps_clip_high=0.06,
                                aggregation="seq_mean_token_mean")  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    ref_logp = logp.detach().clone().requires_grad_(True)
    want = ref_gspo_loss(ref_logp, old, adv_seq, MASK.tolist(), 0.05, 0.06)
    (want_grad,) = torch.autograd.grad(want, ref_logp)
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(grad, want_grad)
    assert grad.abs().sum() > 0 and 0 < metrics["train/pg_clipfrac"] < 1


def test_value_loss_matches_reference():
    gen = torch.Generator().manual_seed(3)
    values = torch.randn(MASK.shape, generator=gen, dtype=torch.float64).requires_grad_(True)
    old = values.detach() + 0.3 * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    returns = torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    loss, metrics = value_loss(values, old, returns, MASK, value_clip=0.2)
    rows, flags = [], []
    for i in range(5):
        r_row, f_row = [], []
        for t in range(6):
            v, o, r = values[i, t].item(), old[i, t].item(), returns[i, t].item()
            vc = o + min(max(v - o, -0.2), 0.2)
            r_row.append(0.5 * max((v - r) ** 2, (vc - r) ** 2))
            f_row.append(float((vc - r) ** 2 > (v - r) ** 2))
        rows.append(r_row)
        flags.append(f_row)
    assert loss.item() == pytest.approx(ref_aggregate(rows, MASK.tolist(), "token_mean"))
    assert metrics["train/value_clipfrac"] == pytest.approx(ref_aggregate(flags, MASK.tolist(), "token_mean"))
    loss.backward()
    clipped = torch.tensor(flags, dtype=torch.bool)
    assert torch.all(values.grad[clipped] == 0) and torch.all(values.grad[(MASK == 0)] == 0)


def test_explained_variance_matches_reference():
    """1 − Var[R − V] / Var[R] over the policy tokens, population variances, written out in float64."""
    gen = torch.Generator().manual_seed(4)
    returns = torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    values = (returns + 0.5 * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)).float()
    pairs = [(returns[i, t].item(), values[i, t].item()) for i in range(5) for t in range(6) if MASK[i, t]]

    def variance(xs):
        mean = sum(xs) / len(xs)
        return sum((x - mean) ** 2 for x in xs) / len(xs)

    want = 1 - variance([r - v for r, v in pairs]) / variance([r for r, _ in pairs])
    assert explained_variance(values, returns.float(), MASK) == pytest.approx(want, rel=1e-6)
    assert explained_variance(returns, returns, MASK) == pytest.approx(1.0)
    assert explained_variance(torch.zeros_like(returns), torch.ones_like(returns), MASK) is None  # returns constant


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "low_var_kl"])
def test_kl_estimators_match_formulas_and_stay_finite(estimator):
    logp = torch.tensor([-1.0, -0.5, -2.0, -3.0, 0.0, -40.0], dtype=torch.float64)
    base = torch.tensor([-1.2, -0.5, -0.1, -60.0, -30.0, 0.0], dtype=torch.float64)
    got = kl_estimate(logp, base, estimator)
    for g, lp, b in zip(got.tolist(), logp.tolist(), base.tolist()):
        log_r = b - lp
        if estimator == "k1":
            want = lp - b
        elif estimator == "k2":
            want = 0.5 * log_r**2
        else:
            clamped = min(max(log_r, -20.0), 20.0)
            want = math.exp(clamped) - 1 - clamped
            if estimator == "low_var_kl":
                want = min(want, 10.0)
        assert g == pytest.approx(want, rel=1e-12)
    assert torch.isfinite(got).all()
    with pytest.raises(ValueError, match="'k4' is unknown"):
        kl_estimate(logp, base, "k4")


def test_sft_loss_is_masked_nll():
    logp, _, _ = batch(4)
    loss, metrics = sft_loss(logp, MASK, aggregation="seq_mean_token_mean")
    assert loss.item() == pytest.approx(ref_aggregate((-logp).tolist(), MASK.tolist(), "seq_mean_token_mean"))
    assert metrics == {"train/sft_loss": loss.item(), "train/loss": loss.item()}


def ref_distill_advantages(task, old, teacher, mask, reward_coef, distill_coef) -> list[list[float]]:
    """Miles' OPD per token from its definition, in float64 loops: A = c_r·A_task + c_d·(log π_T − log π_old)."""
    return [[(reward_coef * a + distill_coef * (t - o)) if m else reward_coef * a
             for a, o, t, m in zip(*rows)] for rows in zip(task, old, teacher, mask)]


@pytest.mark.parametrize("reward_coef, distill_coef", [(1.0, 1.0), (0.8, 0.5), (0.0, 2.0)])
def test_distill_advantages_match_the_per_token_reference(reward_coef, distill_coef):
    _, old, task = batch(5)
    teacher = old - torch.rand(MASK.shape, dtype=torch.float64)
    task = task * MASK
    got = distill_advantages(task, old, teacher, MASK, reward_coef=reward_coef, distill_coef=distill_coef)
    want = ref_distill_advantages(task.tolist(), old.tolist(), teacher.tolist(), MASK.tolist(), reward_coef,
                                  distill_coef)
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), rtol=0, atol=1e-15)
    assert got.dtype == torch.float64 and not got.requires_grad


def test_distill_advantage_gives_the_reverse_kl_policy_gradient_on_policy():
    # With PPO's surrogate at π = π_old, −A_t·∇log π(y_t) with A_t = log π_T − log π is the per-token
    # gradient of the k1 reverse KL: d/dlp of −A·exp(lp − sg(lp)) = (lp − lp_T), per token, over the count.
    logp, _, _ = batch(5)
    teacher = logp.detach() - torch.rand(MASK.shape, dtype=torch.float64)
    advantages = distill_advantages(torch.zeros_like(MASK), logp, teacher, MASK, reward_coef=0.0, distill_coef=1.0)
    loss, _ = policy_loss(logp, logp.detach(), advantages, MASK, aggregation="token_mean")
    loss.backward()
    torch.testing.assert_close(logp.grad, (logp.detach() - teacher) * MASK / MASK.sum())
