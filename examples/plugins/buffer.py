"""A data buffer (`buffer.path`): a class built with the keyword arguments `capacity_groups`,
`max_staleness`, `group_filter` and `on_discard`, offering `async put(group)`,
`async take(n, current_version, timeout=None) -> groups` and `metrics() -> dict`. This one is the default
buffer that also reports the mean reward of the groups it hands to the trainer.

    [buffer]
    path = "examples.plugins.buffer:RewardReportingBuffer"
"""

from __future__ import annotations

from verst.rollout import FifoBuffer
from verst.types import Group


class RewardReportingBuffer(FifoBuffer):
    def __init__(self, capacity_groups, *, max_staleness=None, group_filter=None, on_discard=None):
        super().__init__(capacity_groups, max_staleness=max_staleness, group_filter=group_filter,
                         on_discard=on_discard)
        self._taken_rewards: list[float] = []

    async def take(self, n: int, current_version: int, timeout: float | None = None) -> list[Group]:
        groups = await super().take(n, current_version, timeout)
        self._taken_rewards += [s.reward for g in groups for s in g if isinstance(s.reward, (int, float))]
        return groups

    def metrics(self) -> dict[str, float]:
        """The default buffer's metrics plus `buffer/taken_reward_mean` since the last call."""
        rewards, self._taken_rewards = self._taken_rewards, []
        mean = sum(rewards) / len(rewards) if rewards else 0.0
        return {**super().metrics(), "buffer/taken_reward_mean": mean}
