"""The data buffer between rollout and trainer: a bounded queue of finished groups with three operations, the
oldest weights first.

Aborted and filtered groups are discarded on `put`, stale ones on `take`; replaceable by import path.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import time
from collections.abc import Callable, Sequence
from typing import Literal, Protocol

from verst.config import BufferConfig, ConfigError, load_object
from verst.rollout.filters import GroupFilter, apply_filter
from verst.rollout.keys import PROMPT_TOO_LONG_KEY
from verst.types import Group, Sample, group_is_aborted, group_oldest_version

DiscardReason = Literal["aborted", "filtered", "stale"]
OnDiscard = Callable[[Group, DiscardReason], None]
"""Called once per discarded group with why; sync, called on the event loop. Drop or return prompts."""


class DataBuffer(Protocol):
    """What the loop needs from a buffer (DESIGN.md). A replacement named by `buffer.path` is called
    as `factory(capacity_groups=, max_staleness=, group_filter=, on_discard=)` and provides:

    - `put(group)`: accept one finished group, or discard it (aborted, filtered) through `on_discard`;
      blocks while the buffer holds `capacity_groups` groups.
    - `take(n, current_version, timeout=None)`: remove and return up to n groups, oldest first; waits
      until n are there; never returns a group whose staleness exceeds `max_staleness` (those go to
      `on_discard`). With a timeout it returns the fresh groups it has when the time is up (maybe none).
    - `metrics()`: flat `buffer/` metrics for this training step.
    """

    async def put(self, group: Group) -> None: ...
    async def take(self, n: int, current_version: int, timeout: float | None = None) -> list[Group]: ...
    def metrics(self) -> dict[str, float]: ...


def is_unusable(group: Group) -> bool:
    """A group generation gave up on: any sample aborted, still pending, or failed (e.g. reward error)."""
    return group_is_aborted(group)


class FifoBuffer:
    """The default buffer: groups leave oldest weights first (by the oldest weight version in the group), in the
    order they arrived among groups of the same weights. A group that finished late, behind groups started on
    newer weights, is taken before them and so before it goes stale; groups with no version recorded go first.

    Counters of discarded groups are cumulative; `put_wait_s` and `take_wait_s` sum the seconds
    spent blocked since the previous `metrics()` call; `staleness_*` describe the groups returned by
    the last `take`, `waiting_staleness_*` the groups still queued, against the last version seen.
    A group with no weight version recorded (no engine call, e.g. every sample truncated before
    generation) cannot be stale; it is counted in `buffer/unversioned_groups_total` and left out of the means.
    """

    def __init__(
        self,
        capacity_groups: int,
        *,
        max_staleness: int | None = None,
        group_filter: GroupFilter | None = None,
        on_discard: OnDiscard | None = None,
    ):
        if capacity_groups < 1:
            raise ValueError(f"FifoBuffer: capacity_groups must be >= 1, got {capacity_groups}")
        if max_staleness is not None and max_staleness < 0:
            raise ValueError(f"FifoBuffer: max_staleness must be >= 0 or None, got {max_staleness}")
        self.capacity = capacity_groups
        self.max_staleness = max_staleness
        self._filter = group_filter
        self._on_discard = on_discard
        # by oldest weight version (UNVERSIONED: none recorded), each in arrival order
        self._queues: dict[int, collections.deque[Group]] = {}
        self._changed = asyncio.Condition()
        self._last_version: int | None = None
        self._dropped = {"aborted": 0, "filtered": 0, "stale": 0}
        # (reason, length bucket) -> groups: a length bias in the drops (long groups go stale first) shows here
        self._dropped_by_length: collections.Counter[tuple[str, int]] = collections.Counter()
        self._unversioned = 0
        self._consumed_staleness: list[int] = []  # of the groups returned by the last take
        self._put_wait_s = 0.0
        self._take_wait_s = 0.0

    def __len__(self) -> int:
        return sum(map(len, self._queues.values()))  # one queue per weight version waiting

    async def put(self, group: Group) -> None:
        if not group:
            raise ValueError("FifoBuffer.put: empty group")
        if is_unusable(group):
            self._discard(group, "aborted")
            return
        if self._filter is not None and not apply_filter(self._filter, group):
            self._discard(group, "filtered")
            return
        start = time.monotonic()
        async with self._changed:
            # Cancellation while waiting leaves the queue untouched: the group is either in or not.
            await self._changed.wait_for(lambda: len(self) < self.capacity)
            self._queues.setdefault(_version_key(group), collections.deque()).append(group)
            self._changed.notify_all()
        self._put_wait_s += time.monotonic() - start

    async def take(self, n: int, current_version: int, timeout: float | None = None) -> list[Group]:
        if n < 1:
            raise ValueError(f"FifoBuffer.take: n must be >= 1, got {n}")
        if self._last_version is not None and current_version < self._last_version:
            raise ValueError(
                f"FifoBuffer.take: current_version {current_version} is below the last one seen "
                f"({self._last_version}); weight versions never go back"
            )
        self._last_version = current_version
        start = time.monotonic()
        taken: list[Group] = []
        self._consumed_staleness = []
        try:
            async with asyncio.timeout(timeout), self._changed:
                while len(taken) < n:
                    await self._changed.wait_for(lambda: bool(self._queues))
                    oldest, group = self._pop_oldest()
                    self._changed.notify_all()  # room for a blocked put
                    if self._keep_fresh(group, oldest, current_version):
                        taken.append(group)
        except TimeoutError:
            pass  # documented: the fresh groups gathered so far
        self._take_wait_s += time.monotonic() - start
        return taken

    def metrics(self) -> dict[str, float]:
        waiting = [] if self._last_version is None else [
            self._last_version - oldest for oldest, queue in self._queues.items() if oldest != UNVERSIONED
            for _ in queue]
        out = {
            "buffer/queue_size": float(len(self)),
            "buffer/capacity": float(self.capacity),
            "buffer/dropped_aborted_total": float(self._dropped["aborted"]),
            "buffer/dropped_filtered_total": float(self._dropped["filtered"]),
            "buffer/dropped_stale_total": float(self._dropped["stale"]),
            **{
                f"buffer/dropped_{reason}_len_le_{bucket}_total": float(count)
                for (reason, bucket), count in sorted(self._dropped_by_length.items())
            },
            "buffer/unversioned_groups_total": float(self._unversioned),
            "buffer/staleness_mean": _mean(self._consumed_staleness),
            "buffer/staleness_max": float(max(self._consumed_staleness, default=0)),
            "buffer/waiting_staleness_mean": _mean(waiting),
            "buffer/waiting_staleness_max": float(max(waiting, default=0)),
            "buffer/put_wait_s": self._put_wait_s,
            "buffer/take_wait_s": self._take_wait_s,
        }
        self._put_wait_s = self._take_wait_s = 0.0
        return out

    # ---- checkpoints ---------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The waiting groups (with their weight versions) and the cumulative counters; picklable."""
        return {"groups": self._waiting(), "dropped": dict(self._dropped), "unversioned": self._unversioned,
                "last_version": self._last_version, "dropped_by_length": dict(self._dropped_by_length)}

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict`'s groups (each ahead of any group of the same weights put since) and counters."""
        for group in reversed(state["groups"]):
            self._queues.setdefault(_version_key(group), collections.deque()).appendleft(group)
        self._dropped.update(state["dropped"])
        self._unversioned, self._last_version = state["unversioned"], state["last_version"]
        self._dropped_by_length.update(state.get("dropped_by_length", {}))

    # ---- internals -----------------------------------------------------------------------
    def _pop_oldest(self) -> tuple[int, Group]:
        """The first group of the oldest weights, and that version (its queue's key)."""
        oldest = min(self._queues)
        queue = self._queues[oldest]
        group = queue.popleft()
        if not queue:
            del self._queues[oldest]
        return oldest, group

    def _waiting(self) -> list[Group]:
        """The queued groups in the order `take` returns them."""
        return [group for key in sorted(self._queues) for group in self._queues[key]]

    def _keep_fresh(self, group: Group, oldest: int, current_version: int) -> bool:
        if oldest == UNVERSIONED:
            self._unversioned += 1
            return True
        staleness = current_version - oldest  # pessimistic: the group's oldest token
        if self.max_staleness is not None and staleness > self.max_staleness:
            self._discard(group, "stale")
            return False
        self._consumed_staleness.append(staleness)
        return True

    def _discard(self, group: Group, reason: DiscardReason) -> None:
        self._dropped[reason] += 1
        self._dropped_by_length[reason, length_bucket(group)] += 1
        if self._on_discard is not None:
            self._on_discard(group, reason)


UNVERSIONED = -1  # the queue key of a group with no weight version recorded


def _version_key(group: Group) -> int:
    oldest = group_oldest_version(group)
    return UNVERSIONED if oldest is None else oldest


def length_bucket(group: Group) -> int:
    """The power of two at or above the group's longest response, in tokens (at least 1)."""
    longest = max(s.response_length for s in group)
    return 1 << max(0, longest - 1).bit_length()


def _mean(values: Sequence[int]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


# ---- construction ------------------------------------------------------------------------
def buffer_capacity(cfg: BufferConfig, groups_per_step: int) -> int:
    """Capacity in groups: `capacity_factor` × the groups one training step consumes."""
    if groups_per_step < 1:
        raise ValueError(f"buffer_capacity: groups_per_step must be >= 1, got {groups_per_step}")
    return max(1, int(cfg.capacity_factor * groups_per_step))


def build_buffer(
    cfg: BufferConfig,
    capacity_groups: int,
    on_discard: OnDiscard | None,
    group_filter: GroupFilter | None = None,
) -> DataBuffer:
    """The buffer named by `cfg.path` (default FifoBuffer), checked to provide the three operations."""
    factory = FifoBuffer if cfg.path is None else load_object(cfg.path, "buffer.path")
    buffer = factory(
        capacity_groups=capacity_groups,
        max_staleness=cfg.max_staleness,
        group_filter=group_filter,
        on_discard=on_discard,
    )
    for name, is_async in (("put", True), ("take", True), ("metrics", False)):
        op = getattr(buffer, name, None)
        if not callable(op) or inspect.iscoroutinefunction(op) != is_async:
            kind = "an async method" if is_async else "a plain method"
            raise ConfigError(f"buffer.path = {cfg.path!r}: {type(buffer).__name__}.{name} must be {kind}, got {op!r}")
    return buffer


def discard_handler(
    unused: Literal["drop", "return"], return_prompts: Callable[[Sequence[Sample]], None] | None = None
) -> OnDiscard:
    """The `on_discard` for `buffer.unused`: drop every group, or return prompts of aborted and stale ones
    (except prompts refused as too long).

    Filtered groups are always dropped: the filter judged the group uninformative (e.g. every
    sample already right), so regenerating it would most likely be rejected again.
    """
    if unused == "drop":
        return lambda group, reason: None
    if unused != "return":
        raise ConfigError(f"buffer.unused = {unused!r} is not 'drop' or 'return'")
    if return_prompts is None:
        raise ConfigError("buffer.unused = 'return' needs the data source's return_prompts")

    def on_discard(group: Group, reason: DiscardReason) -> None:
        # A prompt too long to send would only fail again; it was counted when it was refused.
        if reason != "filtered" and not any(PROMPT_TOO_LONG_KEY in s.metadata for s in group):
            return_prompts(group)

    return on_discard
