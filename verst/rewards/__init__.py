"""Layer 1: reward fns (`async reward(sample) -> float | dict`), built-ins by name, a remote client,
and `compute_rewards`, which scores samples and records every failure on its sample.
"""

from verst.config.registries import REWARDS
from verst.rewards.builtin import exact_match, math_verify, numeric_match, token_f1
from verst.rewards.compute import REWARD_ERROR_KEY, build_reward_fn, compute_rewards, reward_metrics
from verst.rewards.remote import RemoteReward
from verst.rewards.values import GroupRewardFn, RewardError, RewardFn, RewardValue, check_reward_value

__all__ = [
    "REWARDS",
    "REWARD_ERROR_KEY",
    "GroupRewardFn",
    "RemoteReward",
    "RewardError",
    "RewardFn",
    "RewardValue",
    "build_reward_fn",
    "check_reward_value",
    "compute_rewards",
    "exact_match",
    "math_verify",
    "numeric_match",
    "register_reward",
    "reward_metrics",
    "token_f1",
]

register_reward = REWARDS.register  # `@register_reward("name")` over an async reward fn, in a `plugins` module
