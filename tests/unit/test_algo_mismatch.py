"""Train–inference mismatch weights (TIS, MIS token/sequence/geometric, IcePop, band mask), their metrics
(raw ratios, effective sample size) and off-policy sequence masking, against loop references."""

from __future__ import annotations

import math

import pytest
import torch

from verst.algo import ess_ratio, ess_ratio_from_moments, mismatch_metrics, mismatch_weights, opsm_keep, rl_loss
from verst.config.schema import AlgorithmConfig

MASK = torch.tensor(
    [
        [1, 1, 1, 1, 0, 0],
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 1, 1],
        [1, 1, 1, 1, 1, 1],
        [0, 0, 0, 0, 0, 0],
    ],
    dtype=torch.float64,
)
LOW, HIGH = 0.5, 2.0


def logprob_pair(seed: int, scale: float = 0.6):
    gen = torch.Generator().manual_seed(seed)
    rollout = -torch.rand(MASK.shape, generator=gen, dtype=torch.float64) * 3
    old = rollout + scale * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    rollout = torch.where(MASK == 0, 0.0, rollout)  # the engine reports 0.0 on environment tokens
    return old, rollout


def ref_weights(mode: str, old: list[list[float]], rollout: list[list[float]], mask: list[list[float]]):
    """Loops over the definitions: (weight, flagged) for each policy token; None elsewhere."""
    out = []
    for o_row, r_row, m_row in zip(old, rollout, mask):
        logs = [o - r for o, r, m in zip(o_row, r_row, m_row) if m]
        row = []
        for o, r, m in zip(o_row, r_row, m_row):
            if not m:
                row.append(None)
                continue
            if mode in ("tis", "mis_token", "icepop", "band_mask"):
                rho = math.exp(o - r)
            elif mode == "mis_sequence":
                rho = math.prod(math.exp(x) for x in logs)
            else:
                rho = math.exp(sum(logs) / len(logs))
            inside = LOW <= rho <= HIGH
            if mode == "tis":
                row.append((min(max(rho, LOW), HIGH), not inside))
            elif mode == "band_mask":
                row.append((1.0 if inside else 0.0, not inside))
            elif mode == "icepop":  # IcePop's M(k): k on [alpha, beta], 0 elsewhere (Ring-1T report)
                row.append((rho if LOW <= rho <= HIGH else 0.0, not inside))
            else:
                row.append((rho if inside else 0.0, not inside))
        out.append(row)
    return out


MODES = ["tis", "mis_token", "mis_sequence", "mis_geometric", "icepop", "band_mask"]


@pytest.mark.parametrize("mode", MODES)
def test_weights_match_reference(mode):
    old, rollout = logprob_pair(0)
    weights, flags = mismatch_weights(mode, old, rollout, MASK, clip_low=LOW, clip_high=HIGH)
    want = ref_weights(mode, old.tolist(), rollout.tolist(), MASK.tolist())
    seen_flag = seen_kept = False
    for i in range(5):
        for t in range(6):
            if want[i][t] is None:
                continue
            w, flagged = want[i][t]
            assert weights[i, t].item() == pytest.approx(w, rel=1e-12), (mode, i, t)
            assert bool(flags[i, t]) == flagged, (mode, i, t)
            seen_flag |= flagged
            seen_kept |= not flagged
    assert seen_flag and seen_kept, "the data should exercise both sides of the band"
    assert not weights.requires_grad


@pytest.mark.parametrize("mode", MODES)
def test_extreme_mismatch_is_finite_and_clipped_or_rejected(mode):
    rollout = torch.full((3, 2), -1.0)
    old = rollout + torch.tensor([[1e3, 1e3], [-1e3, -1e3], [0.1, 0.1]])
    weights, flags = mismatch_weights(mode, old, rollout, torch.ones(3, 2), clip_low=LOW, clip_high=HIGH)
    assert torch.isfinite(weights).all()
    assert flags[:2].all() and not flags[2].any()
    if mode == "tis":
        torch.testing.assert_close(weights[:2], torch.tensor([[HIGH, HIGH], [LOW, LOW]]))
    else:
        assert torch.equal(weights[:2], torch.zeros(2, 2))
    rho = {"mis_sequence": math.exp(0.2), "band_mask": 1.0}.get(mode, math.exp(0.1))
    torch.testing.assert_close(weights[2], torch.full((2,), rho))


def test_zero_lower_bound_never_rejects_small_ratios():
    old, rollout = torch.tensor([[-50.0, -1.0]]), torch.tensor([[-1.0, -1.0]])
    weights, flags = mismatch_weights("mis_token", old, rollout, torch.ones(1, 2), clip_low=0.0, clip_high=2.0)
    assert not flags.any() and weights[0, 1].item() == 1.0 and 0 < weights[0, 0].item() < 1e-8


def test_mismatch_metrics_match_reference():
    old, rollout = logprob_pair(1)
    metrics = mismatch_metrics(old, rollout, MASK, aggregation="token_mean")
    diffs = [(o - r) for o_row, r_row, m_row in zip(old.tolist(), rollout.tolist(), MASK.tolist())
             for o, r, m in zip(o_row, r_row, m_row) if m]  # fmt: skip
    abs_diff = sum(abs(d) for d in diffs) / len(diffs)
    kl = sum(math.exp(d) - 1 - d for d in diffs) / len(diffs)  # k3 of KL(rollout ‖ old), log r = old − rollout
    assert metrics["train/rollout_logprob_abs_diff"] == pytest.approx(abs_diff)
    assert metrics["train/rollout_kl"] == pytest.approx(kl)
    rhos = [math.exp(d) for d in diffs]  # no correction: the raw token ratios
    assert metrics["train/mismatch_ratio_mean"] == pytest.approx(sum(rhos) / len(rhos), rel=1e-12)
    assert metrics["train/mismatch_ratio_max"] == pytest.approx(max(rhos), rel=1e-12)
    assert metrics["train/mismatch_ratio_min"] == pytest.approx(min(rhos), rel=1e-12)
    assert metrics["train/mismatch_ratio_sq_mean"] == pytest.approx(sum(r * r for r in rhos) / len(rhos), rel=1e-12)
    ess = ess_ratio_from_moments(metrics["train/mismatch_ratio_mean"], metrics["train/mismatch_ratio_sq_mean"])
    assert ess == pytest.approx(ref_ess(rhos), rel=1e-12)


def ref_ess(weights: list[float]) -> float:
    """Kong's effective sample size over N: (sum w)^2 / (N * sum w^2)."""
    total = sq = 0.0
    for w in weights:
        total += w
        sq += w * w
    return total * total / (len(weights) * sq)


@pytest.mark.parametrize("correction", ["mis_sequence", "mis_geometric"])
def test_raw_ratio_metrics_are_those_the_sequence_corrections_test(correction):
    old, rollout = logprob_pair(4, scale=0.2)
    metrics = mismatch_metrics(old, rollout, MASK, aggregation="token_mean", correction=correction)
    rhos = []  # the sequence's ratio once per policy token, as the token mean weighs it
    for o_row, r_row, m_row in zip(old.tolist(), rollout.tolist(), MASK.tolist()):
        logs = [o - r for o, r, m in zip(o_row, r_row, m_row) if m]
        if logs:
            seq = sum(logs) if correction == "mis_sequence" else sum(logs) / len(logs)
            rhos += [math.exp(seq)] * len(logs)
    assert metrics["train/mismatch_ratio_mean"] == pytest.approx(sum(rhos) / len(rhos), rel=1e-12)
    assert metrics["train/mismatch_ratio_max"] == pytest.approx(max(rhos), rel=1e-12)
    assert metrics["train/mismatch_ratio_min"] == pytest.approx(min(rhos), rel=1e-12)
    assert metrics["train/mismatch_ratio_sq_mean"] == pytest.approx(sum(r * r for r in rhos) / len(rhos), rel=1e-12)
    ess = ess_ratio_from_moments(metrics["train/mismatch_ratio_mean"], metrics["train/mismatch_ratio_sq_mean"])
    assert ess == pytest.approx(ref_ess(rhos), rel=1e-12)


def test_ess_ratio_bounds_and_edge_cases():
    gen = torch.Generator().manual_seed(7)
    weights = torch.rand(MASK.shape, generator=gen, dtype=torch.float64) * 3
    kept = [w for w_row, m_row in zip(weights.tolist(), MASK.tolist()) for w, m in zip(w_row, m_row) if m]
    assert ess_ratio(weights, MASK).item() == pytest.approx(ref_ess(kept), rel=1e-12)
    assert ess_ratio(torch.full((2, 3), 0.7), torch.ones(2, 3)).item() == pytest.approx(1.0)  # equal weights
    one_hot = torch.tensor([[5.0, 0.0, 0.0, 0.0]])
    assert ess_ratio(one_hot, torch.ones(1, 4)).item() == pytest.approx(0.25)  # one token carries all: 1/N
    assert ess_ratio(torch.ones(2, 2), torch.zeros(2, 2)).item() == 0.0  # no policy token
    assert ess_ratio_from_moments(0.0, 0.0) == 0.0
    assert ess_ratio_from_moments(1.0000001, 1.0) == 1.0  # float32 rounding never lifts it above its bound


def test_icepop_is_the_masked_token_weight():
    old, rollout = logprob_pair(5)
    icepop = mismatch_weights("icepop", old, rollout, MASK, clip_low=LOW, clip_high=HIGH)
    mis = mismatch_weights("mis_token", old, rollout, MASK, clip_low=LOW, clip_high=HIGH)
    assert torch.equal(icepop[0], mis[0]) and torch.equal(icepop[1], mis[1])


def ref_opsm(logp, rollout, adv, mask, delta):
    """DeepSeek-V3.2's M_{i,t}: 0 when A_{i,t} < 0 and mean_t log(pi_rollout / pi_theta) > delta, else 1."""
    keep = []
    for lp_row, r_row, a_row, m_row in zip(logp, rollout, adv, mask):
        terms = [r - lp for lp, r, m in zip(lp_row, r_row, m_row) if m]
        seq_kl = sum(terms) / len(terms) if terms else 0.0
        keep.append([0.0 if (m and a < 0 and seq_kl > delta) else 1.0 for a, m in zip(a_row, m_row)])
    return keep


def test_opsm_drops_negative_advantage_tokens_of_far_off_policy_sequences():
    gen = torch.Generator().manual_seed(8)
    rollout = -torch.rand(MASK.shape, generator=gen, dtype=torch.float64) * 3
    shift = torch.tensor([0.5, -0.5, 0.3, 0.02, 0.0], dtype=torch.float64)[:, None]  # per-sequence drift
    logp = rollout - shift + 0.05 * torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    adv = torch.randn(MASK.shape, generator=gen, dtype=torch.float64)
    adv[0, :2], adv[0, 2:4], adv[2, 1], adv[3, :] = -1.0, 1.0, -1.0, -1.0  # both signs where it matters
    keep, dropped = opsm_keep(logp.requires_grad_(True), rollout, adv, MASK, delta=0.1)
    want = ref_opsm(logp.tolist(), rollout.tolist(), adv.tolist(), MASK.tolist(), 0.1)
    assert keep.tolist() == want
    assert torch.equal(dropped, (keep == 0))
    assert dropped[0, :2].all() and not dropped[0, 2:4].any() and not dropped[3].any()
    assert not keep.requires_grad


def test_opsm_in_the_loss_zeroes_the_dropped_tokens_gradient_and_reports_their_share():
    gen = torch.Generator().manual_seed(9)
    old = -torch.rand(MASK.shape, generator=gen, dtype=torch.float64) * 3
    rollout = old + torch.tensor([0.4, 0.0, -0.4, 0.4, 0.0], dtype=torch.float64)[:, None]
    logp = old.clone().requires_grad_(True)
    adv = -torch.ones(MASK.shape, dtype=torch.float64) * MASK
    loss, metrics = rl_loss(AlgorithmConfig(opsm_delta=0.2), logp, old, adv, MASK, rollout_logprobs=rollout)
    loss.backward()
    want = ref_opsm(logp.tolist(), rollout.tolist(), adv.tolist(), MASK.tolist(), 0.2)
    n = MASK.sum().item()
    dropped = sum(1 for k_row, m_row in zip(want, MASK.tolist()) for k, m in zip(k_row, m_row) if m and k == 0)
    assert dropped == 4 + 6  # rows 0 and 3 (KL 0.4 > 0.2), not row 2 (KL −0.4)
    assert metrics["train/opsm_masked_frac"] == pytest.approx(dropped / n)
    for i in range(5):
        for t in range(6):
            expected = want[i][t] * 1.0 / n if MASK[i, t] else 0.0  # −A·ρ with A = −1, ρ = 1
            assert logp.grad[i, t].item() == pytest.approx(expected, abs=1e-15)


def test_bad_band_and_mode_fail_loudly():
    old, rollout = logprob_pair(2)
    with pytest.raises(ValueError, match="tis_clip_low=2.0, tis_clip=1.0"):
        mismatch_weights("tis", old, rollout, MASK, clip_low=2.0, clip_high=1.0)
    with pytest.raises(ValueError, match="'none' is not registered; registered: tis, mis_token"):
        mismatch_weights("none", old, rollout, MASK, clip_low=0.0, clip_high=2.0)


def test_rejected_tokens_lose_their_gradient_but_keep_their_place_in_the_normaliser():
    old, rollout = logprob_pair(3)
    logp = old.clone().requires_grad_(True)  # on-policy: ratio 1, never PPO-clipped
    adv = torch.ones(MASK.shape, dtype=torch.float64) * MASK
    cfg = AlgorithmConfig(mismatch_correction="mis_token", tis_clip_low=LOW, tis_clip=HIGH)
    loss, metrics = rl_loss(cfg, logp, old, adv, MASK, rollout_logprobs=rollout)
    loss.backward()
    want = ref_weights("mis_token", old.tolist(), rollout.tolist(), MASK.tolist())
    n = MASK.sum().item()
    kept = [w for row in want for w in row if w is not None]
    assert loss.item() == pytest.approx(-sum(w for w, _ in kept) / n)
    assert metrics["train/mis_reject_frac"] == pytest.approx(sum(f for _, f in kept) / n)
    for i in range(5):
        for t in range(6):
            expected = 0.0 if want[i][t] is None else -want[i][t][0] / n
            assert logp.grad[i, t].item() == pytest.approx(expected, abs=1e-15)
