"""Staleness-aware admission for the fully async worker: start a group only if it will still be fresh when the
trainer takes it. AReaL's rate control, per group: the trainer takes `groups_per_step` groups a step, the oldest
weights first and, among groups of the same weights, in the order they reach the buffer, so the i-th trainable
group since the first take (at version v0) is taken at version v0 + i // groups_per_step, or sooner when groups
started on newer weights finished before it. A group started now runs on the version the engines serve, and its
index is the trainable groups that reached the buffer so far plus those still generating that are expected to
pass the filter. It is admitted while v0 + i // groups_per_step minus that version is within `max_staleness`: groups
that would age out are never generated, instead of being dropped as stale.

Counting from the first take keeps the rule free of what a take in progress has popped. Groups discarded on put
(filtered, aborted) and dropped as stale take no index. The engines' version is the newest one seen on a
finished group, and at least the trainer's at its last take less `served_lag` (`sync.interval` - 1).
"""

from __future__ import annotations

import dataclasses

from verst.types import Group

KEEP_PRIOR = 8  # groups of prior belief that every group reaches the trainer, before any is counted


@dataclasses.dataclass
class StalenessGate:
    """`groups_per_step`: groups one train step takes; `max_staleness`: `buffer.max_staleness`; `served_lag`:
    versions the engines may be behind the trainer at a take."""

    groups_per_step: int
    max_staleness: int
    served_lag: int = 0
    finished: int = 0  # groups handed to the buffer
    unusable: int = 0  # of those, discarded on put (aborted or filtered): they never reach the trainer
    stale: int = 0  # of those, dropped as stale when taken
    first_take: int | None = None  # the trainer's version at the worker's first take
    served: int | None = None  # the engines' weight version, as far as seen

    def __post_init__(self) -> None:
        if self.groups_per_step < 1 or self.max_staleness < 0 or self.served_lag < 0:
            raise ValueError(f"StalenessGate: groups_per_step = {self.groups_per_step} must be >= 1, max_staleness "
                             f"= {self.max_staleness} and served_lag = {self.served_lag} >= 0")

    @property
    def keep_rate(self) -> float:
        """The share of finished groups that reach the trainer (filtered and aborted ones do not)."""
        return (self.finished - self.unusable + KEEP_PRIOR) / (self.finished + KEEP_PRIOR)

    def limit(self) -> int:
        """The index below which a group started now is taken within the limit."""
        steps = self.max_staleness
        if self.first_take is not None and self.served is not None:
            steps += self.served - self.first_take
        return (steps + 1) * self.groups_per_step

    def index(self, generating: int) -> float:
        """The expected index of a group started now, counted from the first take."""
        return self.finished - self.unusable - self.stale + generating * self.keep_rate

    def admits(self, generating: int) -> bool:
        """Whether a group started now, behind `generating` groups in flight, is taken within the limit."""
        return self.index(generating) < self.limit()

    # ---- what the worker and the buffer tell it ------------------------------------------------------
    def observe_take(self, version: int) -> None:
        if self.first_take is None:
            self.first_take = version
        self.served = max(self.served if self.served is not None else version, version - self.served_lag)

    def observe_group(self, group: Group) -> None:
        """A group reached the buffer: counted, and its newest weight version read."""
        self.finished += 1
        versions = [int(v) for s in group for v in s.weight_versions if v.isdigit()]
        if versions and self.first_take is not None:
            self.served = max(self.served if self.served is not None else 0, max(versions))

    def count_discard(self, reason: str) -> None:
        """The buffer's `on_discard`: aborted or filtered on put, or stale on take."""
        if reason == "stale":
            self.stale += 1
        else:
            self.unusable += 1

    def metrics(self) -> dict[str, float]:
        return {"rollout/admission_keep_rate": self.keep_rate, "rollout/admission_limit_groups": float(self.limit())}
