"""Train–inference mismatch weights (TIS, MIS token/sequence/geometric, IcePop band) and metrics."""

from __future__ import annotations

import math

import pytest
import torch

from verst.algo import mismatch_metrics, mismatch_weights, rl_loss
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
            if mode in ("tis", "mis_token", "icepop"):
                rho = math.exp(o - r)
            elif mode == "mis_sequence":
                rho = math.prod(math.exp(x) for x in logs)
            else:
                rho = math.exp(sum(logs) / len(logs))
            inside = LOW <= rho <= HIGH
            if mode == "tis":
                row.append((min(max(rho, LOW), HIGH), not inside))
            elif mode == "icepop":
                row.append((1.0 if inside else 0.0, not inside))
            else:
                row.append((rho if inside else 0.0, not inside))
        out.append(row)
    return out


@pytest.mark.parametrize("mode", ["tis", "mis_token", "mis_sequence", "mis_geometric", "icepop"])
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


@pytest.mark.parametrize("mode", ["tis", "mis_token", "mis_sequence", "mis_geometric", "icepop"])
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
    rho = {"mis_sequence": math.exp(0.2), "icepop": 1.0}.get(mode, math.exp(0.1))
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


def test_bad_band_and_mode_fail_loudly():
    old, rollout = logprob_pair(2)
    with pytest.raises(ValueError, match="tis_clip_low=2.0, tis_clip=1.0"):
        mismatch_weights("tis", old, rollout, MASK, clip_low=2.0, clip_high=1.0)
    with pytest.raises(ValueError, match="'none' has no weights"):
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
