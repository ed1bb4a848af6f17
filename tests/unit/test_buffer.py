"""The default data buffer (FIFO, blocking put, discards and staleness) and the group filters."""

import asyncio

import numpy as np
import pytest

from verst.config import BufferConfig, ConfigError, RolloutConfig
from verst.config.registries import GROUP_FILTERS
from verst.rollout import (
    FifoBuffer,
    ZeroStdFilter,
    apply_filter,
    buffer_capacity,
    build_buffer,
    build_filter,
    discard_handler,
    filter_metrics,
)
from verst.types import Sample, Status


def make_group(gi: int, versions=("0",), rewards=(0.0, 1.0), status=Status.COMPLETED) -> list[Sample]:
    """A finished group; `versions` are the weight versions of its first sample (others get the last)."""
    group = []
    for i, r in enumerate(rewards):
        vs = list(versions) if i == 0 else list(versions[-1:])
        group.append(Sample(tokens=[1, 2], response_length=1, loss_mask=[1], rollout_logprobs=[-0.1], reward=r,
                            status=status, weight_versions=vs, group_index=gi, index=gi * 10 + i))
    return group


class Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, group, reason):
        self.calls.append((group[0].group_index, reason))


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 5))


def test_fifo_order_and_exact_take():
    async def go():
        buf = FifoBuffer(8)
        for gi in range(5):
            await buf.put(make_group(gi))
        first = await buf.take(3, current_version=0)
        rest = await buf.take(2, current_version=0)
        return [g[0].group_index for g in first], [g[0].group_index for g in rest], len(buf)

    assert run(go()) == ([0, 1, 2], [3, 4], 0)


def test_put_blocks_when_full_until_take_frees_room():
    async def go():
        buf = FifoBuffer(2)
        await buf.put(make_group(0))
        await buf.put(make_group(1))
        blocked = asyncio.create_task(buf.put(make_group(2)))
        await asyncio.sleep(0.05)
        was_blocked = not blocked.done() and len(buf) == 2
        taken = await buf.take(1, current_version=0)
        await asyncio.wait_for(blocked, 1)
        rest = await buf.take(2, current_version=0)
        return was_blocked, taken[0][0].group_index, [g[0].group_index for g in rest], buf.metrics()

    was_blocked, first, rest, m = run(go())
    assert was_blocked and first == 0 and rest == [1, 2]
    assert m["buffer/put_wait_s"] >= 0.04
    assert m["buffer/capacity"] == 2


def test_take_waits_for_groups_and_timeout_returns_what_is_fresh():
    async def go():
        buf = FifoBuffer(4)
        taking = asyncio.create_task(buf.take(2, current_version=0))
        await asyncio.sleep(0.02)
        waited = not taking.done()
        await buf.put(make_group(0))
        await asyncio.sleep(0.02)
        still = not taking.done()
        await buf.put(make_group(1))
        got = await asyncio.wait_for(taking, 1)
        await buf.put(make_group(2))
        partial = await buf.take(3, current_version=0, timeout=0.05)
        empty = await buf.take(1, current_version=0, timeout=0.01)
        return waited, still, [g[0].group_index for g in got], [g[0].group_index for g in partial], empty, buf.metrics()

    waited, still, got, partial, empty, m = run(go())
    assert waited and still and got == [0, 1]
    assert partial == [2] and empty == []
    assert m["buffer/take_wait_s"] >= 0.05
    assert m["buffer/queue_size"] == 0


@pytest.mark.parametrize("bad", [Status.ABORTED, Status.PENDING, Status.FAILED])
def test_unusable_groups_discarded_on_put(bad):
    async def go():
        rec = Recorder()
        buf = FifoBuffer(4, on_discard=rec)
        group = make_group(0)
        group[1].status = bad
        await buf.put(group)
        await buf.put(make_group(1))
        return rec.calls, len(buf), buf.metrics()

    calls, size, m = run(go())
    assert calls == [(0, "aborted")] and size == 1
    assert m["buffer/dropped_aborted_total"] == 1 and m["buffer/dropped_filtered_total"] == 0


def test_filtered_groups_discarded_on_put_with_counts():
    async def go():
        rec = Recorder()
        zero_std = build_filter("zero_std")
        buf = FifoBuffer(8, group_filter=zero_std, on_discard=rec)
        for gi, rewards in enumerate([(1.0, 1.0), (0.0, 1.0), (0.0, 0.0), (0.5, 0.25)]):
            await buf.put(make_group(gi, rewards=rewards))
        kept = await buf.take(2, current_version=0)
        return rec.calls, [g[0].group_index for g in kept], buf.metrics(), filter_metrics(zero_std)

    calls, kept, m, fm = run(go())
    assert calls == [(0, "filtered"), (2, "filtered")]
    assert kept == [1, 3]
    assert m["buffer/dropped_filtered_total"] == 2 == fm["rollout/zero_std_groups_dropped_total"]


def test_stale_groups_discarded_on_take_never_returned_and_counts_match():
    async def go():
        rec = Recorder()
        buf = FifoBuffer(8, max_staleness=1, on_discard=rec)
        # group 1 has one token from version 1 among version-3 tokens: pessimistic staleness uses 1.
        for gi, versions in enumerate([("0",), ("3", "1"), ("2",), ("3",), ("1",), ("3",)]):
            await buf.put(make_group(gi, versions=versions))
        taken = await buf.take(2, current_version=3)
        return rec.calls, [g[0].group_index for g in taken], buf.metrics()

    calls, taken, m = run(go())
    # the oldest weights first: versions 0, 1 and 1 are stale at 3, then 2 and the first 3 are taken
    assert calls == [(0, "stale"), (1, "stale"), (4, "stale")]
    assert taken == [2, 3]
    assert m["buffer/dropped_stale_total"] == len(calls) == 3
    assert m["buffer/staleness_mean"] == 0.5 and m["buffer/staleness_max"] == 1
    # group 5 still waits: version 3 against the last seen version 3.
    assert m["buffer/waiting_staleness_mean"] == 0 and m["buffer/waiting_staleness_max"] == 0
    assert m["buffer/queue_size"] == 1


def test_groups_that_finished_behind_newer_ones_are_taken_first_and_stay_fresh():
    """A step's groups started on version 9 finish after the next step's, started on 10: taken in arrival order,
    the version-9 ones would be taken at 12, one version past max_staleness = 2; the oldest weights first, none
    is dropped."""
    async def go():
        rec = Recorder()
        buf = FifoBuffer(8, max_staleness=2, on_discard=rec)
        for gi, version in enumerate(["10", "10", "9", "9"]):
            await buf.put(make_group(gi, versions=(version,)))
        first = await buf.take(2, current_version=11)
        second = await buf.take(2, current_version=12, timeout=1.0)  # arrival order would drop 2 and 3 here
        return rec.calls, [[g[0].group_index for g in taken] for taken in (first, second)]

    calls, taken = run(go())
    assert calls == [] and taken == [[2, 3], [0, 1]]


def test_take_rejects_a_version_that_goes_back_and_counts_unversioned_groups():
    async def go():
        buf = FifoBuffer(4, max_staleness=0)
        await buf.put(make_group(0, versions=()))  # no engine call recorded: cannot be stale
        got = await buf.take(1, current_version=5)
        with pytest.raises(ValueError, match="never go back"):
            await buf.take(1, current_version=4)
        return got, buf.metrics()

    got, m = run(go())
    assert len(got) == 1 and m["buffer/unversioned_groups_total"] == 1 and m["buffer/dropped_stale_total"] == 0


def test_wait_times_are_per_metrics_window():
    async def go():
        buf = FifoBuffer(1)
        await buf.take(1, current_version=0, timeout=0.03)
        first = buf.metrics()["buffer/take_wait_s"]
        second = buf.metrics()["buffer/take_wait_s"]
        return first, second

    first, second = run(go())
    assert first >= 0.03 and second == 0.0


def test_build_buffer_capacity_and_errors():
    cfg = BufferConfig(capacity_factor=1.5, max_staleness=2)
    assert buffer_capacity(cfg, 3) == 4
    buf = build_buffer(cfg, buffer_capacity(cfg, 3), None)
    assert isinstance(buf, FifoBuffer) and buf.capacity == 4 and buf.max_staleness == 2
    with pytest.raises(ConfigError, match="buffer.path"):
        build_buffer(BufferConfig(path="collections:OrderedDict"), 2, None)
    with pytest.raises(ValueError, match="capacity_groups"):
        FifoBuffer(0)


def test_discard_handler_drops_or_returns_prompts():
    returned = []
    on_return = discard_handler("return", returned.extend)
    for reason in ("aborted", "filtered", "stale"):
        on_return(make_group(0), reason)
    assert len(returned) == 4  # aborted and stale groups come back; filtered ones are dropped
    discard_handler("drop")(make_group(1), "stale")
    with pytest.raises(ConfigError, match="return_prompts"):
        discard_handler("return")


def test_filters_registry_import_paths_and_return_type():
    assert GROUP_FILTERS.names() == ["zero_std"]
    assert build_filter(None) is None
    by_path = build_filter("verst.rollout.filters:ZeroStdFilter")
    assert by_path is ZeroStdFilter  # an import path names the filter itself
    with pytest.raises(ConfigError, match="'nonzero' is not registered; registered: zero_std"):
        build_filter("nonzero")
    # refused when the config loads, naming the field and the closest name
    with pytest.raises(ValueError, match=r"rollout.dynamic_filter = 'zero-std' is not registered.*did you mean 'zero_std'"):
        RolloutConfig(dynamic_filter="zero-std")
    assert RolloutConfig(dynamic_filter="my_filters:keep_long").dynamic_filter == "my_filters:keep_long"
    keyed = build_filter("zero_std", reward_key="acc")
    group = make_group(0, rewards=(0.0, 0.0))
    group[0].reward, group[1].reward = {"acc": 1.0, "len": 1.0}, {"acc": 0.0, "len": 1.0}
    assert apply_filter(keyed, group) is True
    assert apply_filter(lambda g: np.bool_(False), group) is False
    with pytest.raises(TypeError, match="expected a bool"):
        apply_filter(lambda g: None, group)
    single = ZeroStdFilter()
    assert single(make_group(0, rewards=(1.0,))) is False
    assert single.metrics() == {"rollout/zero_std_groups_dropped_total": 1.0}


def _with_length(group, length):
    for s in group:
        s.tokens, s.response_length = [1] * (length + 1), length
        s.loss_mask, s.rollout_logprobs = [1] * length, [-0.1] * length
    return group


def test_stale_drops_are_counted_per_length_bucket_and_survive_a_checkpoint():
    async def go():
        buf = FifoBuffer(8, max_staleness=0)
        # two long groups (100 and 128 tokens -> bucket 128) and one short (3 -> 4) go stale; one fresh stays.
        for gi, (length, version) in enumerate([(100, "0"), (3, "0"), (128, "1"), (5, "2")]):
            await buf.put(_with_length(make_group(gi, versions=(version,)), length))
        taken = await buf.take(1, current_version=2)
        restored = FifoBuffer(8, max_staleness=0)
        restored.load_state_dict(buf.state_dict())
        return taken, buf.metrics(), restored.metrics()

    taken, m, restored = run(go())
    assert [g[0].group_index for g in taken] == [3]
    assert m["buffer/dropped_stale_len_le_128_total"] == 2 and m["buffer/dropped_stale_len_le_4_total"] == 1
    assert "buffer/dropped_stale_len_le_8_total" not in m
    assert restored["buffer/dropped_stale_len_le_128_total"] == 2
