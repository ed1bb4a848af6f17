"""Group filters: `filter(group) -> bool` (True keeps the group), applied to finished groups.

Built-ins are registered by name in `verst.config.registries.GROUP_FILTERS` (each a class built from the run's
reward key); anything else is an import path to a filter.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

import numpy as np

from verst.config import ConfigError, load_object
from verst.config.registries import GROUP_FILTERS
from verst.types import Group, group_rewards

GroupFilter = Callable[[Group], bool]
"""A filter sees one finished group (every sample has a reward) and returns True to keep it.

It runs on the event loop inside `DataBuffer.put`, so it must be quick and must not block; it must
not modify the group. It returns a plain bool; anything else is an error.
"""


class ZeroStdFilter:
    """DAPO dynamic sampling: reject groups whose rewards all agree (zero variance).

    Under group-normalised advantages (GRPO and kin) such a group has zero advantage on every
    token, so it costs a training slot and teaches nothing (DAPO, Yu et al. 2025, Sec. 3.2).
    """

    def __init__(self, reward_key: str | None = None, eps: float = 1e-8):
        self.reward_key = reward_key
        self.eps = eps
        self.dropped = 0  # zero-variance groups rejected so far

    def __call__(self, group: Group) -> bool:
        rewards = group_rewards(group, self.reward_key)
        # A single-sample group has no spread by definition; pstdev of one value is 0.
        keep = len(rewards) > 0 and statistics.pstdev(rewards) > self.eps
        if not keep:
            self.dropped += 1
        return keep

    def metrics(self) -> dict[str, float]:
        return {"rollout/zero_std_groups_dropped_total": float(self.dropped)}  # over the run


def build_filter(
    spec: str | None, reward_key: str | None = None, field: str = "rollout.dynamic_filter"
) -> GroupFilter | None:
    """The filter named by `spec`: a name in `GROUP_FILTERS`, an import path to a filter, or None for none.

    An import path must name a ready filter (a function or an instance), not a factory.
    """
    if spec is None:
        return None
    if spec in GROUP_FILTERS:
        return GROUP_FILTERS.load(spec)(reward_key)
    if "." not in spec and ":" not in spec:
        raise ConfigError(f"{GROUP_FILTERS.unknown(spec)}; or an import path to a filter")
    fn = load_object(spec, field)
    if not callable(fn):
        raise ConfigError(f"{field} = {spec!r} is not callable ({fn!r}); expected filter(group) -> bool")
    return fn


def apply_filter(group_filter: GroupFilter, group: Group) -> bool:
    """Run a filter and insist on a bool, so a filter returning None never silently drops everything."""
    keep = group_filter(group)
    if isinstance(keep, np.bool_):
        keep = bool(keep)
    if not isinstance(keep, bool):
        raise TypeError(f"group filter {group_filter!r} returned {keep!r} ({type(keep).__name__}); expected a bool")
    return keep


def filter_metrics(group_filter: GroupFilter | None) -> dict[str, float]:
    """The filter's own metrics if it reports any (the built-in zero_std filter does)."""
    report = getattr(group_filter, "metrics", None)
    return dict(report()) if callable(report) else {}
