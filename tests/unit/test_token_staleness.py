"""The per-token staleness correction: each token's age (trainer version − the version that sampled it, from
`Sample.token_versions`) rejects policy tokens older than `algorithm.max_token_staleness` in the loss, and its
metrics; against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from verst.algo import rl_loss, stale_token_keep, staleness_metrics
from verst.config.schema import AlgorithmConfig
from verst.trainer.rl_steps import token_staleness
from verst.types import Sample, Status

# Two partial rollouts and a plain sample at trainer version 5: row 0 sampled by versions 2, 2, 4, 5; row 1 by
# 3, 3, 3 then (padding); row 2 has an environment token (mask 0) between versions 5.
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0], [1, 0, 1, 0]], dtype=torch.float64)
AGE = torch.tensor([[3, 3, 1, 0], [2, 2, 2, 0], [0, 9, 0, 0]], dtype=torch.float64)  # 9: an env token, never read


def test_tokens_older_than_the_limit_are_rejected_and_the_rest_kept():
    keep, rejected = stale_token_keep(AGE, MASK, max_staleness=1)
    assert keep.tolist() == [[0, 0, 1, 1], [0, 0, 0, 1], [1, 1, 1, 1]]
    assert rejected.tolist() == [[True, True, False, False], [True, True, True, False], [False] * 4]
    assert stale_token_keep(AGE, MASK, max_staleness=3)[0].tolist() == [[1] * 4] * 3
    with pytest.raises(ValueError, match="max_token_staleness must be >= 0; got -1"):
        stale_token_keep(AGE, MASK, max_staleness=-1)


def test_staleness_metrics_are_the_policy_tokens_mean_age_and_share_from_older_weights():
    m = staleness_metrics(AGE, MASK, aggregation="token_mean")
    assert m["train/token_staleness_mean"] == pytest.approx((3 + 3 + 1 + 0 + 2 + 2 + 2 + 0 + 0) / 9)
    assert m["train/stale_token_frac"] == pytest.approx(6 / 9)
    per_sequence = staleness_metrics(AGE, MASK, aggregation="seq_mean_token_mean")
    assert per_sequence["train/token_staleness_mean"] == pytest.approx((7 / 4 + 6 / 3 + 0) / 3)


def test_the_loss_gives_stale_tokens_weight_zero_and_reports_them():
    old = -torch.rand(MASK.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    logp = old.clone().requires_grad_(True)  # on-policy: ratio 1, never clipped; each token's loss is −A
    adv = torch.ones(MASK.shape, dtype=torch.float64) * MASK
    loss, metrics = rl_loss(AlgorithmConfig(max_token_staleness=1), logp, old, adv, MASK, token_staleness=AGE)
    loss.backward()
    kept = [[0, 0, 1, 1], [0, 0, 0, 0], [1, 0, 1, 0]]
    assert loss.item() == pytest.approx(-4 / 9)  # 4 fresh tokens of 9: the stale ones keep their place in N
    torch.testing.assert_close(logp.grad, torch.tensor(kept, dtype=torch.float64) * (-1 / 9), rtol=0, atol=1e-15)
    assert metrics["train/stale_token_reject_frac"] == pytest.approx(5 / 9)
    assert metrics["train/stale_token_frac"] == pytest.approx(6 / 9)
    # no limit: nothing rejected, the age still measured
    loss, metrics = rl_loss(AlgorithmConfig(), logp, old, adv, MASK, token_staleness=AGE)
    assert loss.item() == pytest.approx(-1.0) and "train/stale_token_reject_frac" not in metrics
    assert metrics["train/token_staleness_mean"] == pytest.approx(13 / 9)
    with pytest.raises(ValueError, match="algorithm.max_token_staleness = 1 needs token_staleness"):
        rl_loss(AlgorithmConfig(max_token_staleness=1), logp, old, adv, MASK)


def test_each_samples_token_ages_come_from_its_token_versions_else_its_oldest_version():
    def sample(n, **kw):
        return Sample(tokens=[1] * (n + 2), response_length=n, loss_mask=[1] * n, rollout_logprobs=[0.0] * n,
                      status=Status.COMPLETED, **kw)

    continued = sample(4, weight_versions=["2", "4"], token_versions=[2, 2, 4, 4])
    unknown = sample(3, weight_versions=["3", "4"])  # a call an update fell inside: every token counts as 3's
    unversioned = sample(2)
    assert token_staleness([continued, unknown, unversioned], 5) == [[3, 3, 1, 1], [2, 2, 2], [0, 0]]
