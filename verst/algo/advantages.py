"""Advantage estimators: rewards (and critic values) to per-token advantages [batch, resp_len].

GRPO, Dr.GRPO, RLOO, REINFORCE++ (and its group baseline) and PPO's GAE, each registered by name
(`verst.config.registries.ADVANTAGE_ESTIMATORS`), and `compute_advantages`, which runs the configured one.

Conventions (see `verst.algo.aggregation`): `rewards [batch]`, `group_ids [batch]` (samples of one
prompt share an id; groups may differ in size and appear in any order), `loss_mask [batch, resp_len]`.
Advantages are 0 on masked tokens. Time steps of the token-level estimators (REINFORCE++, GAE) are
the policy tokens only: environment tokens between turns are not actions, so discounting skips them
and carries the running return across unchanged. Call these on the whole global batch (before
micro-batching): group statistics and batch normalisation need all of it. Results carry no gradient.
"""

from __future__ import annotations

import torch

from verst.algo.aggregation import check_token_shapes
from verst.algo.kl import kl_estimate
from verst.config.registries import ADVANTAGE_ESTIMATORS
from verst.config.schema import AlgorithmConfig

# Added to a std before dividing (GRPO groups, REINFORCE++ batch whitening).
STD_EPS = 1e-6
Estimate = tuple[torch.Tensor, torch.Tensor | None]  # (advantages, returns or None), [batch, resp_len] each


def _group_index(group_ids: torch.Tensor, rewards: torch.Tensor) -> tuple[torch.Tensor, int]:
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if group_ids.shape != rewards.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards and group_ids must both be [batch]; got {tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    _, inverse = torch.unique(group_ids, return_inverse=True)  # [batch] -> 0..G-1
    return inverse, int(inverse.max().item()) + 1 if inverse.numel() else 0


def _group_sum(values: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=values.dtype, device=values.device).index_add_(0, inverse, values)


def _float_rewards(rewards: torch.Tensor) -> torch.Tensor:
    rewards = torch.as_tensor(rewards).detach()
    return rewards if rewards.is_floating_point() else rewards.to(torch.float32)


@torch.no_grad()
def group_relative_rewards(rewards: torch.Tensor, group_ids: torch.Tensor, *, std_normalize: bool) -> torch.Tensor:
    """GRPO scalar advantages [batch]: (r_i − mean_g) / (std_g + 1e-6) (Shao et al. 2024,
    arXiv:2402.03300, §4.1.2, outcome supervision); without `std_normalize` just r_i − mean_g (Dr.GRPO,
    Liu et al. 2025, arXiv:2503.20783). std is the unbiased (Bessel) group std. A group whose
    rewards are all equal (including a group of one) gets exactly 0, never NaN.
    """
    rewards = _float_rewards(rewards)
    inverse, n_groups = _group_index(group_ids, rewards)
    counts = _group_sum(torch.ones_like(rewards), inverse, n_groups)  # [G]
    mean = _group_sum(rewards, inverse, n_groups) / counts  # [G]
    centred = rewards - mean[inverse]  # [batch]
    if std_normalize:
        var = _group_sum(centred.square(), inverse, n_groups) / (counts - 1).clamp(min=1)
        centred = centred / (var.sqrt()[inverse] + STD_EPS)
    lo = torch.full((n_groups,), float("inf"), dtype=rewards.dtype, device=rewards.device)
    hi = torch.full((n_groups,), float("-inf"), dtype=rewards.dtype, device=rewards.device)
    lo = lo.scatter_reduce(0, inverse, rewards, reduce="amin")
    hi = hi.scatter_reduce(0, inverse, rewards, reduce="amax")
    # A float mean of equal values can differ from them by an ulp; force the constant group to 0.
    constant = (lo == hi)[inverse]
    return torch.where(constant, torch.zeros_like(centred), centred)


@torch.no_grad()
def rloo_rewards(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """RLOO scalar advantages [batch]: r_i − mean_{j≠i} r_j over the sample's group (Kool et al. 2019,
    "Buy 4 REINFORCE samples, get a baseline for free!"; Ahmadian et al. 2024, arXiv:2402.14740).
    A group of one sample has no leave-one-out baseline and is an error.
    """
    rewards = _float_rewards(rewards)
    inverse, n_groups = _group_index(group_ids, rewards)
    counts = _group_sum(torch.ones_like(rewards), inverse, n_groups)
    if bool((counts < 2).any()):
        ids = torch.unique(torch.as_tensor(group_ids))[counts < 2].tolist()
        raise ValueError(f"RLOO needs at least 2 samples per group; groups {ids} have 1")
    totals = _group_sum(rewards, inverse, n_groups)
    return rewards - (totals[inverse] - rewards) / (counts[inverse] - 1)


def broadcast_to_tokens(scalar: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """A per-sample value [batch] on every policy token -> [batch, resp_len] (0 on masked tokens)."""
    return torch.where(loss_mask != 0, scalar[:, None], torch.zeros((), dtype=scalar.dtype, device=scalar.device))


def _token_rewards(
    rewards: torch.Tensor, loss_mask: torch.Tensor, kl_coef: float, kl: torch.Tensor | None
) -> torch.Tensor:
    """Per-token rewards [batch, resp_len]: −kl_coef·kl_t on policy tokens, plus the scalar reward
    on each sample's last policy token."""
    mask = loss_mask != 0
    token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    if kl is not None and kl_coef != 0.0:
        token_rewards = torch.where(mask, -kl_coef * kl.to(rewards.dtype), token_rewards)
    positions = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=-1).values  # [batch]; -1: no policy token
    has_tokens = last >= 0
    rows = torch.arange(mask.shape[0], device=mask.device)[has_tokens]
    token_rewards[rows, last[has_tokens]] += rewards[has_tokens]
    return token_rewards


@torch.no_grad()
def discounted_returns(token_rewards: torch.Tensor, loss_mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ·G_{t+1} over policy tokens (masked tokens skipped, returns 0 there)."""
    check_token_shapes(loss_mask, token_rewards=token_rewards)
    mask = loss_mask != 0
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])  # [batch]
    for t in reversed(range(token_rewards.shape[1])):
        updated = token_rewards[:, t] + gamma * running
        running = torch.where(mask[:, t], updated, running)
        returns[:, t] = torch.where(mask[:, t], updated, torch.zeros_like(updated))
    return returns


@torch.no_grad()
def batch_whiten(values: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """(x − mean) / (std + 1e-6) over all policy tokens of the batch (population std); 0 on masked."""
    mask = loss_mask != 0
    count = int(mask.sum().item())
    if count == 0:
        raise ValueError("batch normalisation of advantages needs at least one policy token; loss_mask is all 0")
    mean = values[mask].mean()
    std = (values[mask] - mean).square().mean().sqrt()
    return torch.where(mask, (values - mean) / (std + STD_EPS), torch.zeros_like(values))


@torch.no_grad()
def reinforce_plus_plus(
    rewards: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    gamma: float,
    kl_coef: float = 0.0,
    kl: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ advantages [batch, resp_len] (Hu et al. 2025, arXiv:2501.03262).

    Token rewards r_t = −kl_coef·kl_t (+ the scalar reward on the last policy token), discounted
    returns G_t = Σ_{k≥t} γ^{k−t} r_k, then whitened over all policy tokens of the batch. For the
    group-baseline variant, subtract the group mean from `rewards` first (see `compute_advantages`).
    """
    rewards = _float_rewards(rewards)
    check_token_shapes(loss_mask, kl=kl)
    returns = discounted_returns(_token_rewards(rewards, loss_mask, kl_coef, kl), loss_mask, gamma)
    return batch_whiten(returns, loss_mask)


@torch.no_grad()
def gae(
    rewards: torch.Tensor,
    values: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    gamma: float,
    lam: float,
    kl_coef: float = 0.0,
    kl: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO advantages and returns with GAE (Schulman et al. 2016, arXiv:1506.02438, eq. 16; PPO,
    Schulman et al. 2017, arXiv:1707.06347, eq. 11–12) -> (advantages, returns), both [batch, resp_len].

    δ_t = r_t + γ·V_{t+1} − V_t, A_t = δ_t + γλ·A_{t+1}, returns R_t = A_t + V_t. Token rewards as in
    REINFORCE++ (−kl_coef·kl_t, scalar reward on the last policy token). The value after the last
    policy token is 0 (the episode ends; a truncated response is not bootstrapped). Not whitened.
    """
    rewards = _float_rewards(rewards)
    check_token_shapes(loss_mask, values=values, kl=kl)
    mask = loss_mask != 0
    values = values.detach().to(rewards.dtype)
    token_rewards = _token_rewards(rewards, loss_mask, kl_coef, kl)
    advantages = torch.zeros_like(token_rewards)
    next_value = torch.zeros_like(rewards)  # [batch]
    next_adv = torch.zeros_like(rewards)
    for t in reversed(range(token_rewards.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = torch.where(mask[:, t], adv, torch.zeros_like(adv))
        next_adv = torch.where(mask[:, t], adv, next_adv)
        next_value = torch.where(mask[:, t], values[:, t], next_value)
    returns = torch.where(mask, advantages + values, torch.zeros_like(advantages))
    return advantages, returns


def compute_advantages(
    cfg: AlgorithmConfig,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Advantages [batch, resp_len] per `cfg.advantage_estimator`, and returns [batch, resp_len] for
    `ppo` (the value-loss target) or None.

    `logprobs` (old policy) and `ref_logprobs` are needed when `cfg.kl_penalty_coef > 0`, which only
    REINFORCE++ and PPO fold into rewards (kl_t = `cfg.kl_estimator` of old vs reference); for the
    group estimators use `kl_loss_coef` instead. `values` (critic, old) are needed for `ppo`.
    With `cfg.whiten_advantages` the advantages are then whitened over the batch's policy tokens
    (`batch_whiten`; the returns are not).
    """
    advantages, returns = _estimate(
        cfg, rewards, group_ids, loss_mask, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values
    )
    if cfg.whiten_advantages:
        advantages = batch_whiten(advantages, loss_mask)
    return advantages, returns


def _estimate(
    cfg: AlgorithmConfig,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    values: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`compute_advantages` before whitening: the registered estimator of `cfg.advantage_estimator`."""
    rewards = _float_rewards(rewards)
    check_token_shapes(loss_mask, logprobs=logprobs, ref_logprobs=ref_logprobs, values=values)
    if rewards.shape != loss_mask.shape[:1]:
        raise ValueError(f"rewards has shape {tuple(rewards.shape)}; expected [batch] = {tuple(loss_mask.shape[:1])}")
    name = cfg.advantage_estimator
    if cfg.kl_penalty_coef > 0 and not ADVANTAGE_ESTIMATORS.entry(name).token_level:
        raise ValueError(f"kl_penalty_coef = {cfg.kl_penalty_coef} is folded into rewards only by the token-level "
                         f"estimators, not by advantage_estimator = {name!r}; use kl_loss_coef")
    kl = None
    if cfg.kl_penalty_coef > 0:
        if logprobs is None or ref_logprobs is None:
            raise ValueError(f"kl_penalty_coef = {cfg.kl_penalty_coef} needs logprobs and ref_logprobs")
        kl = kl_estimate(logprobs.detach(), ref_logprobs, cfg.kl_estimator)
    return ADVANTAGE_ESTIMATORS.load(name)(cfg, rewards, group_ids, loss_mask, kl=kl, values=values)


# ---- the registered estimators: `fn(cfg, rewards, group_ids, loss_mask, *, kl, values) -> (advantages, returns)`
def grpo_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor,
                    *, kl: torch.Tensor | None = None, values: torch.Tensor | None = None) -> Estimate:
    """GRPO: the group-relative reward on every policy token (std-normalised with `grpo_std_normalization`)."""
    scalar = group_relative_rewards(rewards, group_ids, std_normalize=cfg.grpo_std_normalization)
    return broadcast_to_tokens(scalar, loss_mask), None


def dr_grpo_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor,
                       *, kl: torch.Tensor | None = None, values: torch.Tensor | None = None) -> Estimate:
    """Dr. GRPO: r − group mean on every policy token, no std division."""
    return broadcast_to_tokens(group_relative_rewards(rewards, group_ids, std_normalize=False), loss_mask), None


def rloo_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor,
                    *, kl: torch.Tensor | None = None, values: torch.Tensor | None = None) -> Estimate:
    """RLOO: r − the mean of the group's other rewards, on every policy token."""
    return broadcast_to_tokens(rloo_rewards(rewards, group_ids), loss_mask), None


def reinforce_plus_plus_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor,
                                   loss_mask: torch.Tensor, *, kl: torch.Tensor | None = None,
                                   values: torch.Tensor | None = None) -> Estimate:
    """REINFORCE++: discounted token returns (with the KL penalty), whitened over the batch."""
    return reinforce_plus_plus(rewards, loss_mask, gamma=cfg.gamma, kl_coef=cfg.kl_penalty_coef, kl=kl), None


def reinforce_plus_plus_baseline_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor,
                                            loss_mask: torch.Tensor, *, kl: torch.Tensor | None = None,
                                            values: torch.Tensor | None = None) -> Estimate:
    """REINFORCE++ on group-centred rewards (r − group mean)."""
    centred = group_relative_rewards(rewards, group_ids, std_normalize=False)
    return reinforce_plus_plus(centred, loss_mask, gamma=cfg.gamma, kl_coef=cfg.kl_penalty_coef, kl=kl), None


def ppo_advantages(cfg: AlgorithmConfig, rewards: torch.Tensor, group_ids: torch.Tensor, loss_mask: torch.Tensor,
                   *, kl: torch.Tensor | None = None, values: torch.Tensor | None = None) -> Estimate:
    """PPO: GAE over the critic's values; the returns are the value loss's targets."""
    if values is None:
        raise ValueError("advantage_estimator = 'ppo' needs critic values [batch, resp_len]")
    return gae(rewards, values, loss_mask, gamma=cfg.gamma, lam=cfg.lam, kl_coef=cfg.kl_penalty_coef, kl=kl)


def distill_advantages(
    task_advantages: torch.Tensor,
    old_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    loss_mask: torch.Tensor,
    *,
    reward_coef: float = 1.0,
    distill_coef: float,
) -> torch.Tensor:
    """On-policy distillation as a per-token advantage term -> advantages [batch, resp_len].

    A_t = reward_coef · A_task_t + distill_coef · (log π_teacher(y_t) − log π_old(y_t)) on policy tokens,
    0 elsewhere. The second term is minus the k1 estimate of the reverse KL(π_old ‖ π_teacher) on the
    sampled token: with PPO's surrogate its gradient at π = π_old is the per-token reverse-KL policy
    gradient (Agarwal et al. 2024, arXiv:2306.13649, on-policy GKD with reverse KL; Miles' OPD
    `advantage −= coef · (student − teacher)`), with no credit to later tokens. The old logprobs are
    detached: the term is a fixed reward per token, as a task advantage is. `reward_coef = 0` trains on
    the teacher alone (pure OPD).
    """
    check_token_shapes(loss_mask, task_advantages=task_advantages, old_logprobs=old_logprobs,
                       teacher_logprobs=teacher_logprobs)
    distill = (teacher_logprobs - old_logprobs.detach()) * loss_mask
    return reward_coef * task_advantages + distill_coef * distill
