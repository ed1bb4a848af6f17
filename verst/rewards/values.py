"""The reward contract: fn signatures, what a reward value may be, and RewardError for unscorable samples.

A wrong answer is a low reward; RewardError means no reward exists, and it is never replaced by a default.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from verst.types import Sample

RewardValue = float | dict[str, float]
RewardFn = Callable[[Sample], Awaitable[RewardValue]]  # async def reward(sample) -> float | dict
GroupRewardFn = Callable[[list[Sample]], Awaitable[list[RewardValue]]]  # async def reward_group(samples)


class RewardError(RuntimeError):
    """A sample could not be scored; the message says why (timeout, HTTP status, bad reply, bad label)."""


def check_reward_value(value: Any, where: str) -> RewardValue:
    """A finite number (bools count as 0/1), or a non-empty dict of them; else RewardError naming `where`."""
    if isinstance(value, dict):
        if not value:
            raise RewardError(f"{where}: reward is an empty dict")
        return {str(k): _finite(v, f"{where}: reward[{k!r}]") for k, v in value.items()}
    return _finite(value, f"{where}: reward")


def _finite(value: Any, where: str) -> float:
    if not isinstance(value, (int, float)):
        raise RewardError(f"{where} must be a number, got {value!r:.80}")
    if not math.isfinite(value):
        raise RewardError(f"{where} must be finite, got {value}")
    return float(value)
