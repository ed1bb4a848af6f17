"""Resolve the configured reward fn and score samples with it, recording every failure on its sample.

`reward.type` is a registered reward's name, 'remote' (an HTTP service) or 'custom' (an import path).
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Sequence

from verst.config import ConfigError, RewardConfig, load_object
from verst.config.registries import REWARDS
from verst.config.rules import group_rewards_need_a_group_fn, reward_source_has_its_setting
from verst.rewards.remote import RemoteReward
from verst.rewards.values import GroupRewardFn, RewardError, RewardFn, RewardValue, check_reward_value
from verst.types import Sample, Status

REWARD_ERROR_KEY = "reward_error"  # sample.metadata key holding why a sample could not be scored


def build_reward_fn(cfg: RewardConfig) -> RewardFn | GroupRewardFn:
    """The async reward fn named by `cfg`: a registered reward (`REWARDS`), a RemoteReward for 'remote', or
    the function at `reward.path` for 'custom' (a group fn with `reward.group`)."""
    try:
        reward_source_has_its_setting(cfg)
        group_rewards_need_a_group_fn(cfg)
    except ValueError as error:  # the config's rules, for a reward section built on its own
        raise ConfigError(str(error)) from None
    if cfg.type == "custom":
        fn = load_object(cfg.path, "reward.path")
        if not (inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))):
            raise ConfigError(f"reward.path = {cfg.path!r} is not an async function ({fn!r}); use 'async def'")
        return fn
    if cfg.type == "remote":
        return RemoteReward(cfg.url, timeout_s=cfg.timeout_s, max_concurrency=cfg.max_concurrency)
    if REWARDS.entry(cfg.type).takes_model:
        return REWARDS.load(cfg.type)(cfg.model_path)
    return REWARDS.load(cfg.type)


async def compute_rewards(
    samples: Sequence[Sample],
    reward: RewardConfig | RewardFn | GroupRewardFn,
    *,
    group: bool | None = None,
    key: str | None = None,
) -> dict[str, float]:
    """Set `sample.reward` on every sample; return `rollout/` and `time/` metrics.

    `reward` is a config (its `group` and `key` apply, and a client built here is closed here) or a
    fn (then `group` says whether it takes whole groups, and `key` selects from dict rewards).
    A RewardError marks its sample FAILED with the reason in `metadata['reward_error']`.
    """
    owned = isinstance(reward, RewardConfig)
    if owned:
        if group is not None or key is not None:
            raise TypeError("compute_rewards: pass group/key through the RewardConfig, not as arguments")
        fn, group, key = build_reward_fn(reward), reward.group, reward.key
    else:
        fn = reward
    start = time.perf_counter()
    try:
        if group:
            await asyncio.gather(*(_score_group(fn, g, key) for g in _split_groups(samples)))
        elif len(samples) == 1:  # a rollout scores each sample as it finishes: no task for one
            await _score_sample(fn, samples[0], key)
        else:
            await asyncio.gather(*(_score_sample(fn, s, key) for s in samples))
    finally:
        if owned and isinstance(fn, RemoteReward):
            await fn.aclose()
    return reward_metrics(samples, key) | {"time/reward_s": time.perf_counter() - start}


async def _score_sample(fn: RewardFn, sample: Sample, key: str | None) -> None:
    try:
        _set_reward(sample, await fn(sample), key)
    except RewardError as e:
        _fail(sample, str(e))


async def _score_group(fn: GroupRewardFn, samples: list[Sample], key: str | None) -> None:
    try:
        values = await fn(samples)
        if not isinstance(values, list) or len(values) != len(samples):
            raise RewardError(
                f"group reward fn returned {type(values).__name__} of length "
                f"{len(values) if isinstance(values, list) else '-'} for a group of {len(samples)} samples"
            )
    except RewardError as e:
        for s in samples:
            _fail(s, f"group {s.group_index}: {e}")
        return
    for s, value in zip(samples, values):
        try:
            _set_reward(s, value, key)
        except RewardError as e:
            _fail(s, str(e))


def _set_reward(sample: Sample, value: RewardValue, key: str | None) -> None:
    value = check_reward_value(value, f"sample {sample.index}")
    if isinstance(value, dict) and key not in value:
        raise RewardError(f"sample {sample.index}: dict reward with keys {sorted(value)}; reward.key = {key!r} selects none")
    sample.reward = value


def _fail(sample: Sample, reason: str) -> None:
    sample.reward = None
    sample.status = Status.FAILED
    sample.metadata[REWARD_ERROR_KEY] = reason


def _split_groups(samples: Sequence[Sample]) -> list[list[Sample]]:
    """Samples grouped by `group_index`, groups in order of first appearance."""
    groups: dict[int, list[Sample]] = {}
    for s in samples:
        groups.setdefault(s.group_index, []).append(s)
    return list(groups.values())


def reward_metrics(samples: Sequence[Sample], key: str | None = None) -> dict[str, float]:
    """Failure count, mean scalar reward and, for dict rewards, the mean of each component."""
    scored = [s for s in samples if s.reward is not None]
    metrics = {"rollout/reward_failures": float(len(samples) - len(scored))}
    if scored:
        metrics["rollout/reward_mean"] = sum(s.reward_value(key) for s in scored) / len(scored)
    components: dict[str, list[float]] = {}
    for s in scored:
        if isinstance(s.reward, dict):
            for name, v in s.reward.items():
                components.setdefault(name, []).append(v)
    for name, values in components.items():
        metrics[f"rollout/reward/{name}"] = sum(values) / len(values)
    return metrics
