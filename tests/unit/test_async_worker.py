"""The fully async worker on an event-loop-driven fake engine: replacement rules, pause, stop, errors."""

import asyncio
import random

import pytest

from tests import virtual_time
from tests.fake_source import NumberedSource
from verst.config import RolloutConfig
from verst.rollout import GENERATE_ERROR_KEY, AsyncRolloutWorker, FifoBuffer
from verst.types import Status


def long_tail(seed=0, fast=0.004, slow=0.08, p_slow=0.15):
    """Per-sample latency: mostly `fast`, sometimes 20x longer (long-tailed response lengths)."""
    rng = random.Random(seed)
    table = {}

    def latency(index):
        if index not in table:
            table[index] = slow if rng.random() < p_slow else fast
        return table[index]

    return latency


def fake_generate(latency=lambda index: 0.002, fail=()):
    async def generate_sample(sample):
        await asyncio.sleep(latency(sample.index))
        if sample.index in fail:
            raise ConnectionError(f"engine dropped request {sample.index}")
        sample.tokens = sample.tokens + [7]
        sample.response_length, sample.loss_mask, sample.rollout_logprobs = 1, [1], [-0.5]
        sample.weight_versions.append("0")
        sample.reward = float(sample.index % 2)
        sample.status = Status.COMPLETED
        return sample

    return generate_sample


async def until(condition, timeout=2.0):
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not condition() and loop.time() < end:
        await asyncio.sleep(0.005)


async def drain(worker, seconds):
    """Consume groups like a trainer for `seconds`; return them."""
    got = []
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    while (left := end - loop.time()) > 0:
        got += await worker.take(4, current_version=0, timeout=left)
    return got


def occupancies(*granularities):
    """One worker per granularity, all in one event loop over the same 0.8 s of virtual time (a stalled
    machine changes nothing); each worker's metrics."""
    async def go():
        workers = [AsyncRolloutWorker(NumberedSource(), FifoBuffer(1000), n_samples_per_prompt=4, max_in_flight=16,
                                      granularity=granularity, generate_sample=fake_generate(long_tail()))
                   for granularity in granularities]
        for worker in workers:
            worker.start()
        await asyncio.gather(*(drain(worker, 0.8) for worker in workers))
        metrics = [worker.metrics() for worker in workers]
        for worker in workers:
            await worker.stop()
        return metrics

    return virtual_time.run(go())


def test_sample_granularity_keeps_occupancy_higher_than_group_granularity():
    by_sample, by_group = occupancies("sample", "group")
    # Expected (analytically) about 0.85 vs 0.45 for this latency mix.
    assert by_sample["rollout/slot_occupancy"] > by_group["rollout/slot_occupancy"] + 0.2, (by_sample, by_group)
    assert by_sample["rollout/slot_occupancy"] > 0.65
    assert by_sample["rollout/groups_produced_total"] > by_group["rollout/groups_produced_total"]
    # the rate is reported (comparing two wall-clock rates would test the machine's load, not the worker)
    assert by_sample["perf/rollout_tokens_per_s"] > 0 and by_group["perf/rollout_tokens_per_s"] > 0


def test_never_more_than_max_in_flight_and_buffer_backpressure():
    async def go():
        source, buffer = NumberedSource(), FifoBuffer(2)
        peak = 0

        async def generate(sample):
            nonlocal peak
            peak = max(peak, worker.in_flight)
            return await fake_generate()(sample)

        worker = AsyncRolloutWorker(source, buffer, n_samples_per_prompt=3, max_in_flight=7, generate_sample=generate)
        worker.start()
        await asyncio.sleep(0.2)  # nobody takes: the buffer fills and the worker stops starting groups
        drawn = len(source.groups)
        await asyncio.sleep(0.1)
        idle = worker.in_flight
        leftovers = await worker.stop()
        return peak, drawn, len(source.groups), idle, len(buffer), len(leftovers)

    peak, drawn, drawn_later, idle, queued, leftovers = asyncio.run(go())
    assert peak <= 7 and drawn == drawn_later and idle == 0
    # 2 in the buffer, 1 blocked in put, the rest of the places (2 groups of 3 in 7) finished and waiting
    assert queued == 2 and drawn == queued + leftovers


def test_pause_resume_loses_nothing():
    async def go():
        source, buffer = NumberedSource(), FifoBuffer(1000)
        worker = AsyncRolloutWorker(source, buffer, n_samples_per_prompt=2, max_in_flight=6,
                                    generate_sample=fake_generate(lambda i: 0.01))
        worker.start()
        await asyncio.sleep(0.05)
        worker.pause()
        drawn_at_pause = len(source.groups)
        # in-flight groups finish and reach the buffer; nothing new starts
        await until(lambda: worker.in_flight == 0 and len(buffer) == drawn_at_pause)
        await asyncio.sleep(0.03)
        paused_state = (len(source.groups), worker.in_flight, len(buffer), worker.paused)
        worker.resume()
        await asyncio.sleep(0.05)
        got = await worker.take(len(buffer), current_version=0)
        leftovers = await worker.stop()
        got += await buffer.take(max(len(buffer), 1), current_version=0, timeout=0.01)  # put before stop
        return drawn_at_pause, paused_state, got, leftovers, source.groups

    drawn_at_pause, (drawn, in_flight, queued, paused), got, leftovers, all_groups = asyncio.run(go())
    assert paused and drawn == drawn_at_pause and in_flight == 0 and queued == drawn_at_pause
    ids = sorted(g[0].group_index for g in got + leftovers)
    assert ids == list(range(len(all_groups)))  # every drawn group arrived exactly once or came back
    assert all(s.status is Status.COMPLETED for g in got for s in g)


def test_stop_returns_leftovers_aborted_through_callback():
    async def go():
        source = NumberedSource()
        buffer = FifoBuffer(1000)
        slow = {1, 3}  # samples 1 and 3 (groups 0 and 1) never finish before stop

        worker = AsyncRolloutWorker(source, buffer, n_samples_per_prompt=2, max_in_flight=4,
                                    generate_sample=fake_generate(lambda i: 10.0 if i in slow else 0.001),
                                    on_leftover=source.return_prompts)
        worker.start()
        await asyncio.sleep(0.05)
        leftovers = await worker.stop()
        return leftovers, source.returned, len(source.groups), len(buffer), worker.in_flight

    leftovers, returned, drawn, queued, in_flight = asyncio.run(go())
    ids = [g[0].group_index for g in leftovers]
    assert ids == returned and ids[:2] == [0, 1]  # the stuck groups, plus any started just before stop
    assert queued + len(leftovers) == drawn and in_flight == 0
    for g in leftovers[:2]:
        assert g[0].status is Status.COMPLETED  # finished samples keep their result
        assert g[1].status is Status.ABORTED and g[1].metadata[GENERATE_ERROR_KEY] == "stopped"
    assert all(s.status in (Status.COMPLETED, Status.ABORTED) for g in leftovers for s in g)


def test_generation_exceptions_become_aborted_samples_counted_and_discarded():
    async def go():
        source, discarded = NumberedSource(), []
        buffer = FifoBuffer(1000, on_discard=lambda g, reason: discarded.append((g, reason)))
        worker = AsyncRolloutWorker(source, buffer, n_samples_per_prompt=2, max_in_flight=4,
                                    generate_sample=fake_generate(fail={0, 5}))
        worker.start()
        got = await worker.take(3, current_version=0)
        m, bm = worker.metrics(), buffer.metrics()
        await worker.stop()
        return got, discarded, m, bm

    got, discarded, m, bm = asyncio.run(go())
    assert sorted(g[0].group_index for g, _ in discarded) == [0, 2]
    assert {reason for _, reason in discarded} == {"aborted"}
    failed = [s for g, _ in discarded for s in g if s.status is Status.ABORTED]
    assert sorted(s.index for s in failed) == [0, 5]
    assert all("ConnectionError" in s.metadata[GENERATE_ERROR_KEY] for s in failed)
    assert m["rollout/generate_errors_total"] == 2 and bm["buffer/dropped_aborted_total"] == 2
    assert [g[0].group_index for g in got] == [1, 3, 4]


def test_generate_group_with_group_granularity_and_a_failing_finish_hook():
    async def go():
        source, buffer = NumberedSource(), FifoBuffer(1000)
        per_sample = fake_generate()

        async def generate_group(group):
            return list(await asyncio.gather(*(per_sample(s) for s in group)))

        async def group_reward(group):
            if group[0].group_index == 1:
                raise RuntimeError("reward service down")
            for s in group:
                s.reward = 1.0

        worker = AsyncRolloutWorker(source, buffer, n_samples_per_prompt=3, max_in_flight=6, granularity="group",
                                    generate_group=generate_group, finish_group=group_reward)
        worker.start()
        got = await worker.take(3, current_version=0)
        m, bm = worker.metrics(), buffer.metrics()
        await worker.stop()
        return got, m, bm

    got, m, bm = asyncio.run(go())
    assert 1 not in [g[0].group_index for g in got] and all(s.reward == 1.0 for g in got for s in g)
    assert m["rollout/generate_errors_total"] == 3 and bm["buffer/dropped_aborted_total"] == 1


def test_worker_bug_propagates_to_take_and_stop():
    async def go():
        async def wrong(sample):
            await asyncio.sleep(0.001)
            return {"not": "a sample"}

        worker = AsyncRolloutWorker(NumberedSource(), FifoBuffer(10), n_samples_per_prompt=2, max_in_flight=2,
                                    generate_sample=wrong)
        worker.start()
        with pytest.raises(RuntimeError, match="rollout worker failed") as took:
            await asyncio.wait_for(worker.take(1, current_version=0), 2)
        with pytest.raises(RuntimeError, match="rollout worker failed"):
            await worker.stop()
        return took.value.__cause__

    cause = asyncio.run(go())
    assert "expected Sample" in repr(cause)


def test_configuration_errors_and_from_config():
    source, buffer, gen = NumberedSource(), FifoBuffer(2), fake_generate()
    with pytest.raises(ValueError, match="needs generate_sample"):
        AsyncRolloutWorker(source, buffer, n_samples_per_prompt=2, max_in_flight=4, generate_group=gen)
    with pytest.raises(ValueError, match="max_in_flight = 3"):
        AsyncRolloutWorker(source, buffer, n_samples_per_prompt=4, max_in_flight=3, generate_sample=gen)
    with pytest.raises(ValueError, match="exactly one"):
        AsyncRolloutWorker(source, buffer, n_samples_per_prompt=1, max_in_flight=1)
    worker = AsyncRolloutWorker.from_config(RolloutConfig(batch_size=4, n_samples_per_prompt=2), source, buffer,
                                            generate_sample=gen)
    assert (worker.max_in_flight, worker.n, worker.granularity) == (8, 2, "sample")
