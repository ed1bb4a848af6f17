"""Staleness-aware admission: the gate's arithmetic, and the fully async worker under a trainer slower than its
engines: without the gate groups age out of the buffer; with it none does, at the same trained throughput."""

import asyncio

import pytest

from tests.fake_source import NumberedSource
from verst.config import load_config
from verst.rollout import AsyncRolloutWorker, FifoBuffer
from verst.rollout.admission import KEEP_PRIOR, StalenessGate
from verst.rollout.from_config import admission_gate
from verst.types import Sample, Status


def group(version):
    return [Sample(weight_versions=[str(version)])]


def test_a_group_is_admitted_while_it_would_be_taken_within_the_limit():
    gate = StalenessGate(groups_per_step=4, max_staleness=1)
    assert gate.limit() == 8  # before the first take: the first two steps' groups
    gate.observe_take(10)  # resumed at version 10
    assert gate.admits(generating=7) and not gate.admits(generating=8)
    for _ in range(4):
        gate.observe_group(group(10))  # step 11 takes these four
    gate.observe_take(11)  # the engines serve 11: groups 0-3 are trained, 4-11 are taken at 11 and 12
    assert gate.limit() == 12
    assert gate.admits(generating=7) and not gate.admits(generating=8)


def test_discarded_groups_take_no_index_and_filtered_ones_lower_the_expectation():
    gate = StalenessGate(groups_per_step=4, max_staleness=1)
    for _ in range(3 * KEEP_PRIOR):
        gate.observe_group(group(0))
    for _ in range(2 * KEEP_PRIOR):
        gate.count_discard("filtered")  # two thirds of the finished groups were filtered
    gate.count_discard("stale")
    assert gate.keep_rate == pytest.approx(1 / 2)  # (24 - 16 + 8) / (24 + 8)
    assert gate.index(generating=4) == pytest.approx(24 - 16 - 1 + 2)


def test_the_engines_version_lags_the_trainer_by_the_sync_interval():
    gate = StalenessGate(groups_per_step=4, max_staleness=1, served_lag=2)
    gate.observe_take(0)
    gate.observe_take(5)
    assert gate.served == 3 and gate.limit() == (1 + 3 + 1) * 4


def test_auto_admission_follows_the_staleness_limit():
    fully_async = ["--schedule", "fully_async"]
    assert admission_gate(load_config(None, fully_async)) is None  # no limit: nothing to pace
    gate = admission_gate(load_config(None, [*fully_async, "--buffer.max-staleness", "2"]))
    assert (gate.groups_per_step, gate.max_staleness) == (32, 2)
    assert admission_gate(load_config(None, [*fully_async, "--buffer.max-staleness", "2",
                                             "--rollout.admission", "fill"])) is None


def engine_at(version):
    async def generate_sample(sample):
        await asyncio.sleep(0.002)
        sample.tokens = sample.tokens + [7]
        sample.response_length, sample.loss_mask, sample.rollout_logprobs = 1, [1], [-0.5]
        sample.weight_versions.append(str(version[0]))
        sample.reward, sample.status = 1.0, Status.COMPLETED
        return sample

    return generate_sample


async def train(gate, steps=12, per_step=2, step_s=0.03):
    """A trainer slower than the engines: each step takes `per_step` groups, trains `step_s`, pushes a version."""
    version = [0]
    buffer = FifoBuffer(capacity_groups=64, max_staleness=1)
    worker = AsyncRolloutWorker(NumberedSource(), buffer, n_samples_per_prompt=2, max_in_flight=64,
                                generate_sample=engine_at(version), admission=gate)
    worker.start()
    trained = 0
    for _ in range(steps):
        trained += len(await worker.take(per_step, version[0]))
        await asyncio.sleep(step_s)
        version[0] += 1
    await worker.stop()
    return buffer.metrics()["buffer/dropped_stale_total"], trained


def test_without_the_gate_groups_age_out_and_with_it_none_does():
    stale, trained = asyncio.run(train(None))
    assert stale > 0 and trained == 24
    stale, trained = asyncio.run(train(StalenessGate(groups_per_step=2, max_staleness=1)))
    assert stale == 0 and trained == 24
