"""Advantage estimators against plain float64 references written with python loops."""

from __future__ import annotations

import math
import random

import pytest
import torch

from verst.algo import (
    broadcast_to_tokens,
    compute_advantages,
    gae,
    group_relative_rewards,
    reinforce_plus_plus,
    rloo_rewards,
)
from verst.config.schema import AlgorithmConfig

# Rows: a normal response with padding, a length-1 response, a multi-turn response with an
# environment-token gap, a full-length response, and a response of only environment tokens.
MASK_ROWS = [
    [1, 1, 1, 1, 0, 0],
    [1, 0, 0, 0, 0, 0],
    [1, 1, 0, 0, 1, 1],
    [1, 1, 1, 1, 1, 1],
    [0, 0, 0, 0, 0, 0],
]


def make_mask(batch: int) -> torch.Tensor:
    return torch.tensor([MASK_ROWS[i % len(MASK_ROWS)] for i in range(batch)], dtype=torch.float64)


def ref_group_rewards(rewards: list[float], gids: list[int], std: bool) -> list[float]:
    out = []
    for i, r in enumerate(rewards):
        group = [rewards[j] for j in range(len(rewards)) if gids[j] == gids[i]]
        mean = sum(group) / len(group)
        if max(group) == min(group):
            out.append(0.0)
        elif std:
            sd = math.sqrt(sum((g - mean) ** 2 for g in group) / (len(group) - 1))
            out.append((r - mean) / (sd + 1e-6))
        else:
            out.append(r - mean)
    return out


def ref_policy_positions(mask_row: list[float]) -> list[int]:
    return [t for t, m in enumerate(mask_row) if m != 0]


def ref_k3(logp: float, base: float) -> float:
    log_r = base - logp
    return math.exp(log_r) - 1 - log_r


def ref_token_rewards(reward: float, mask_row, kl_row, coef: float) -> dict[int, float]:
    positions = ref_policy_positions(mask_row)
    rewards = {t: -coef * kl_row[t] for t in positions}
    if positions:
        rewards[positions[-1]] += reward
    return rewards


def ref_reinforce_pp(rewards, mask, kl, coef, gamma) -> list[list[float]]:
    returns = [[0.0] * len(mask[0]) for _ in mask]
    for i, row in enumerate(mask):
        token_rewards = ref_token_rewards(rewards[i], row, kl[i], coef)
        running = 0.0
        for t in reversed(ref_policy_positions(row)):
            running = token_rewards[t] + gamma * running
            returns[i][t] = running
    flat = [returns[i][t] for i, row in enumerate(mask) for t in ref_policy_positions(row)]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / len(flat))
    return [
        [(returns[i][t] - mean) / (std + 1e-6) if row[t] else 0.0 for t in range(len(row))] for i, row in enumerate(mask)
    ]


def ref_gae(rewards, values, mask, kl, coef, gamma, lam):
    adv = [[0.0] * len(mask[0]) for _ in mask]
    ret = [[0.0] * len(mask[0]) for _ in mask]
    for i, row in enumerate(mask):
        token_rewards = ref_token_rewards(rewards[i], row, kl[i], coef)
        positions = ref_policy_positions(row)
        next_value, next_adv = 0.0, 0.0
        for t in reversed(positions):
            delta = token_rewards[t] + gamma * next_value - values[i][t]
            next_adv = delta + gamma * lam * next_adv
            next_value = values[i][t]
            adv[i][t] = next_adv
            ret[i][t] = next_adv + values[i][t]
    return adv, ret


def expand(scalars: list[float], mask: torch.Tensor) -> torch.Tensor:
    return torch.tensor([[s if m else 0.0 for m in row] for s, row in zip(scalars, mask.tolist())], dtype=torch.float64)


@pytest.fixture
def grouped():
    """Groups of sizes 3, 1, 4, 2 (one of them all-equal at 0.1), shuffled order."""
    rng = random.Random(0)
    gids = [5] * 3 + [2] + [9] * 4 + [0] * 2
    rewards = [rng.random() for _ in range(3)] + [0.7] + [0.1] * 4 + [1.0, 0.0]
    order = list(range(len(gids)))
    rng.shuffle(order)
    return [rewards[k] for k in order], [gids[k] for k in order]


@pytest.mark.parametrize("std", [True, False])
def test_group_relative_rewards_match_reference(grouped, std):
    rewards, gids = grouped
    got = group_relative_rewards(torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids), std_normalize=std)
    want = torch.tensor(ref_group_rewards(rewards, gids, std), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    constant = [i for i, g in enumerate(gids) if g in (2, 9)]  # the single sample and the all-0.1 group
    assert all(got[i].item() == 0.0 for i in constant)


def test_all_equal_rewards_give_exact_zero_never_nan():
    rewards = torch.full((6,), 0.1, dtype=torch.float32)  # 0.1 is not exact in binary: the mean drifts by an ulp
    got = group_relative_rewards(rewards, torch.tensor([1, 1, 1, 2, 2, 3]), std_normalize=True)
    assert torch.equal(got, torch.zeros(6))


@pytest.mark.parametrize("estimator,std", [("grpo", True), ("grpo", False), ("dr_grpo", True)])
def test_dispatcher_group_estimators_broadcast_on_policy_tokens(grouped, estimator, std):
    rewards, gids = grouped
    mask = make_mask(len(rewards))
    cfg = AlgorithmConfig(advantage_estimator=estimator, grpo_std_normalization=std)
    adv, returns = compute_advantages(cfg, torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids), mask)
    use_std = estimator == "grpo" and std
    torch.testing.assert_close(adv, expand(ref_group_rewards(rewards, gids, use_std), mask), rtol=1e-10, atol=1e-12)
    assert returns is None and not adv.requires_grad


def test_rloo_matches_reference():
    rewards, gids = [0.3, 1.0, 0.0, 0.5, 2.0, -1.0, 4.0], [1, 0, 1, 0, 1, 0, 0]
    want = []
    for i, r in enumerate(rewards):
        others = [rewards[j] for j in range(len(rewards)) if gids[j] == gids[i] and j != i]
        want.append(r - sum(others) / len(others))
    got = rloo_rewards(torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids))
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    adv, _ = compute_advantages(
        AlgorithmConfig(advantage_estimator="rloo"), torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids),
        make_mask(7),
    )  # fmt: skip
    torch.testing.assert_close(adv, expand(want, make_mask(7)))


def test_rloo_refuses_a_group_of_one():
    with pytest.raises(ValueError, match=r"groups \[7\] have 1"):
        rloo_rewards(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([3, 3, 7]))


def random_logprobs(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return -torch.rand(shape, generator=gen, dtype=torch.float64) * 3


@pytest.mark.parametrize("coef,gamma", [(0.0, 1.0), (0.05, 0.9)])
def test_reinforce_plus_plus_matches_reference(coef, gamma):
    mask = make_mask(5)
    rewards = [1.0, 0.0, 0.5, -1.0, 2.0]
    logp, ref = random_logprobs((5, 6), 1), random_logprobs((5, 6), 2)
    kl = [[ref_k3(logp[i, t].item(), ref[i, t].item()) for t in range(6)] for i in range(5)]
    cfg = AlgorithmConfig(advantage_estimator="reinforce_plus_plus", kl_penalty_coef=coef, gamma=gamma, kl_estimator="k3")
    adv, returns = compute_advantages(
        cfg, torch.tensor(rewards, dtype=torch.float64), torch.arange(5), mask, logprobs=logp, ref_logprobs=ref
    )
    want = ref_reinforce_pp(rewards, mask.tolist(), kl, coef, gamma)
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-10)
    assert returns is None


def test_reinforce_plus_plus_baseline_subtracts_group_mean_first():
    mask = make_mask(6)
    rewards, gids = [1.0, 0.0, 0.5, 3.0, 1.0, 2.0], [0, 0, 0, 1, 1, 1]
    centred = [r - sum(rewards[j] for j in range(6) if gids[j] == g) / 3 for r, g in zip(rewards, gids)]
    zeros = [[0.0] * 6 for _ in range(6)]
    cfg = AlgorithmConfig(advantage_estimator="reinforce_plus_plus_baseline", gamma=0.95)
    adv, _ = compute_advantages(cfg, torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids), mask)
    want = ref_reinforce_pp(centred, mask.tolist(), zeros, 0.0, 0.95)
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=1e-9, atol=1e-10)


def test_reinforce_plus_plus_needs_a_policy_token():
    with pytest.raises(ValueError, match="at least one policy token"):
        reinforce_plus_plus(torch.tensor([1.0]), torch.zeros(1, 3), gamma=1.0)


@pytest.mark.parametrize("coef,gamma,lam", [(0.0, 1.0, 1.0), (0.1, 0.9, 0.8)])
def test_gae_matches_reference(coef, gamma, lam):
    mask = make_mask(5)
    rewards = [1.0, -0.5, 0.5, 0.0, 2.0]
    values = torch.randn(5, 6, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    logp, ref = random_logprobs((5, 6), 4), random_logprobs((5, 6), 5)
    kl = [[logp[i, t].item() - ref[i, t].item() for t in range(6)] for i in range(5)]  # k1
    cfg = AlgorithmConfig(advantage_estimator="ppo", gamma=gamma, lam=lam, kl_penalty_coef=coef, kl_estimator="k1")
    adv, returns = compute_advantages(
        cfg, torch.tensor(rewards, dtype=torch.float64), torch.arange(5), mask,
        logprobs=logp, ref_logprobs=ref, values=values,
    )  # fmt: skip
    want_adv, want_ret = ref_gae(rewards, values.tolist(), mask.tolist(), kl, coef, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(returns, torch.tensor(want_ret, dtype=torch.float64), rtol=1e-10, atol=1e-12)


def test_gae_gamma_lambda_one_without_kl_is_reward_minus_value():
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 9.0, 0.6]])
    adv, returns = gae(torch.tensor([1.0]), values, mask, gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.8, 0.6, 0.0, 0.4]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))


def test_dispatcher_fails_loudly():
    rewards, gids, mask = torch.tensor([1.0, 0.0]), torch.tensor([0, 0]), torch.ones(2, 3)
    with pytest.raises(ValueError, match="kl_penalty_coef = 0.1"):
        compute_advantages(AlgorithmConfig(kl_penalty_coef=0.1), rewards, gids, mask)
    with pytest.raises(ValueError, match="needs critic values"):
        compute_advantages(AlgorithmConfig(advantage_estimator="ppo"), rewards, gids, mask)
    with pytest.raises(ValueError, match="needs logprobs and ref_logprobs"):
        compute_advantages(AlgorithmConfig(advantage_estimator="reinforce_plus_plus", kl_penalty_coef=0.1), rewards, gids, mask)
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\)"):
        compute_advantages(AlgorithmConfig(), torch.tensor([1.0, 0.0, 1.0]), gids, mask)
    with pytest.raises(ValueError, match=r"values has shape \(2, 4\)"):
        compute_advantages(AlgorithmConfig(advantage_estimator="ppo"), rewards, gids, mask, values=torch.zeros(2, 4))


def test_integer_rewards_and_list_group_ids_are_accepted():
    adv = group_relative_rewards(torch.tensor([1, 0, 1, 1]), [0, 0, 1, 1], std_normalize=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))
    torch.testing.assert_close(
        broadcast_to_tokens(adv, torch.tensor([[1, 0], [1, 1], [0, 0], [1, 1]])),
        torch.tensor([[0.5, 0.0], [-0.5, -0.5], [0.0, 0.0], [0.0, 0.0]]),
    )


def ref_whiten(values: list[list[float]], mask: list[list[float]]) -> list[list[float]]:
    """(A − mean) / (std + 1e-6) with the population mean and std over the policy tokens; 0 elsewhere."""
    policy = [v for row, m_row in zip(values, mask) for v, m in zip(row, m_row) if m]
    mean = sum(policy) / len(policy)
    std = math.sqrt(sum((v - mean) ** 2 for v in policy) / len(policy))
    return [[(v - mean) / (std + 1e-6) if m else 0.0 for v, m in zip(row, m_row)] for row, m_row in zip(values, mask)]


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline", "ppo"])
def test_whiten_advantages_whitens_every_estimator_over_policy_tokens(estimator):
    rng = random.Random(1)
    gids = [3, 3, 3, 1, 1, 7, 7, 7, 7]  # every group of two or more: RLOO needs it
    rewards = [rng.random() for _ in gids]
    mask = make_mask(len(rewards))
    values = torch.randn(mask.shape, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    args = (torch.tensor(rewards, dtype=torch.float64), torch.tensor(gids), mask)
    raw, raw_returns = compute_advantages(AlgorithmConfig(advantage_estimator=estimator), *args, values=values)
    cfg = AlgorithmConfig(advantage_estimator=estimator, whiten_advantages=True)
    adv, returns = compute_advantages(cfg, *args, values=values)
    want = ref_whiten(raw.tolist(), mask.tolist())
    torch.testing.assert_close(adv, torch.tensor(want, dtype=torch.float64), rtol=1e-10, atol=1e-12)
    policy = adv[mask != 0]
    assert abs(policy.mean().item()) < 1e-12 and policy.std(correction=0).item() == pytest.approx(1.0, rel=1e-5)
    if estimator == "ppo":
        torch.testing.assert_close(returns, raw_returns)  # the value targets are not whitened
