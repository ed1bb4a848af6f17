"""The DataBuffer contract, run against the default buffer and a replacement loaded by import path.

Order is not part of the contract (a replacement may select differently); counts, blocking,
waiting, discards and metric keys are.
"""

import asyncio

import pytest

from verst.config import BufferConfig
from verst.rollout import build_buffer, is_unusable
from verst.types import Group, Sample, Status, group_staleness

REQUIRED_METRICS = {
    "buffer/queue_size", "buffer/capacity", "buffer/dropped_aborted_total", "buffer/dropped_filtered_total",
    "buffer/dropped_stale_total", "buffer/staleness_mean", "buffer/staleness_max", "buffer/waiting_staleness_mean",
    "buffer/waiting_staleness_max", "buffer/put_wait_s", "buffer/take_wait_s",
}


class NewestFirstBuffer:
    """A tiny replacement: hands out the freshest groups first (LIFO), same discard rules."""

    def __init__(self, *, capacity_groups, max_staleness, group_filter, on_discard):
        self.capacity, self.max_staleness = capacity_groups, max_staleness
        self.filter, self.on_discard = group_filter, on_discard
        self.items: list[Group] = []
        self.cond = asyncio.Condition()
        self.dropped = {"aborted": 0, "filtered": 0, "stale": 0}
        self.version = 0

    def _drop(self, group, reason):
        self.dropped[reason] += 1
        self.on_discard(group, reason)

    async def put(self, group):
        if is_unusable(group):
            return self._drop(group, "aborted")
        if self.filter is not None and not self.filter(group):
            return self._drop(group, "filtered")
        async with self.cond:
            await self.cond.wait_for(lambda: len(self.items) < self.capacity)
            self.items.append(group)
            self.cond.notify_all()

    async def take(self, n, current_version, timeout=None):
        self.version = current_version
        out = []
        try:
            async with asyncio.timeout(timeout), self.cond:
                while len(out) < n:
                    await self.cond.wait_for(lambda: self.items)
                    group = self.items.pop()
                    self.cond.notify_all()
                    if self.max_staleness is not None and group_staleness(group, current_version) > self.max_staleness:
                        self._drop(group, "stale")
                    else:
                        out.append(group)
        except TimeoutError:
            pass
        return out

    def metrics(self):
        waiting = [group_staleness(g, self.version) for g in self.items]
        return {
            "buffer/queue_size": len(self.items), "buffer/capacity": self.capacity,
            **{f"buffer/dropped_{k}_total": v for k, v in self.dropped.items()},
            "buffer/staleness_mean": 0.0, "buffer/staleness_max": 0.0,
            "buffer/waiting_staleness_mean": sum(waiting) / len(waiting) if waiting else 0.0,
            "buffer/waiting_staleness_max": max(waiting, default=0),
            "buffer/put_wait_s": 0.0, "buffer/take_wait_s": 0.0,
        }


# docs/plugins.md's example buffer keeps the contract too
BUFFERS = [None, f"{__name__}:NewestFirstBuffer", "examples.plugins.buffer:RewardReportingBuffer"]


def make_group(gi: int, version: int = 0, status=Status.COMPLETED, rewards=(0.0, 1.0)) -> Group:
    return [
        Sample(tokens=[1, 2], response_length=1, loss_mask=[1], rollout_logprobs=[-0.1], reward=r, status=status,
               weight_versions=[str(version)], group_index=gi, index=gi * 10 + i)
        for i, r in enumerate(rewards)
    ]


def make(path, capacity=3, max_staleness=None, group_filter=None):
    discarded = []
    buf = build_buffer(BufferConfig(path=path, max_staleness=max_staleness), capacity,
                       lambda g, reason: discarded.append((g[0].group_index, reason)), group_filter)
    return buf, discarded


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))


@pytest.mark.parametrize("path", BUFFERS)
def test_put_take_counts_and_metric_keys(path):
    async def go():
        buf, _ = make(path)
        for gi in range(3):
            await buf.put(make_group(gi))
        got = await buf.take(2, current_version=0)
        m = buf.metrics()
        rest = await buf.take(1, current_version=0)
        return got + rest, m

    groups, m = run(go())
    assert sorted(g[0].group_index for g in groups) == [0, 1, 2]
    assert REQUIRED_METRICS <= set(m) and m["buffer/queue_size"] == 1 and m["buffer/capacity"] == 3


@pytest.mark.parametrize("path", BUFFERS)
def test_put_blocks_when_full_and_take_waits(path):
    async def go():
        buf, _ = make(path, capacity=1)
        await buf.put(make_group(0))
        blocked = asyncio.create_task(buf.put(make_group(1)))
        await asyncio.sleep(0.03)
        put_was_blocked = not blocked.done()
        await buf.take(1, current_version=0)
        await asyncio.wait_for(blocked, 1)
        await buf.take(1, current_version=0)
        taking = asyncio.create_task(buf.take(1, current_version=0))
        await asyncio.sleep(0.03)
        take_was_waiting = not taking.done()
        await buf.put(make_group(2))
        got = await asyncio.wait_for(taking, 1)
        timed_out = await buf.take(1, current_version=0, timeout=0.02)
        return put_was_blocked, take_was_waiting, got[0][0].group_index, timed_out

    assert run(go()) == (True, True, 2, [])


@pytest.mark.parametrize("path", BUFFERS)
def test_discards_match_callbacks_and_metrics(path):
    def keep_nonzero_std(group):
        return len({s.reward for s in group}) > 1

    async def go():
        buf, discarded = make(path, capacity=8, max_staleness=2, group_filter=keep_nonzero_std)
        await buf.put(make_group(0, status=Status.ABORTED))
        await buf.put(make_group(1, rewards=(1.0, 1.0)))
        for gi, version in [(2, 0), (3, 1), (4, 3), (5, 0)]:
            await buf.put(make_group(gi, version=version))
        got = await buf.take(2, current_version=3)  # versions 0 are stale (3 - 0 > 2)
        return discarded, got, buf.metrics()

    discarded, got, m = run(go())
    by_reason = {r: sorted(gi for gi, rr in discarded if rr == r) for r in ("aborted", "filtered", "stale")}
    assert by_reason["aborted"] == [0] and by_reason["filtered"] == [1]
    assert sorted(g[0].group_index for g in got) == [3, 4]
    assert all(group_staleness(g, 3) <= 2 for g in got)
    for reason, groups in by_reason.items():
        assert m[f"buffer/dropped_{reason}_total"] == len(groups)
    # what was neither taken nor discarded is still queued
    assert m["buffer/queue_size"] == 6 - len(discarded) - len(got)
