"""A fully async trainer waiting on groups that never come is told why: the worker's progress (groups finished,
dropped by reason with the setting that drops them, trajectories generating), read without resetting a metric
window."""

import asyncio
import collections

from tests.fake_source import NumberedSource
from verst.config import VerstConfig
from verst.rollout import AsyncRolloutWorker, FifoBuffer
from verst.rollout.filters import ZeroStdFilter
from verst.rollout.from_config import counted, worker_progress
from verst.types import Status

N = 2  # samples per prompt


async def same_reward(sample):
    """Every sample of every group earns 0: the zero-variance filter drops each group."""
    await asyncio.sleep(0.001)
    sample.tokens = sample.tokens + [7]
    sample.response_length, sample.loss_mask, sample.rollout_logprobs = 1, [1], [-0.5]
    sample.weight_versions.append("0")
    sample.status, sample.reward = Status.COMPLETED, 0.0
    return sample


def test_a_waiting_trainer_is_told_every_group_was_filtered():
    cfg = VerstConfig.model_validate({"schedule": "fully_async", "rollout": {"dynamic_filter": "zero_std"},
                                      "buffer": {"max_staleness": 2}})
    discarded = collections.Counter()
    buffer = FifoBuffer(capacity_groups=4, max_staleness=2, group_filter=ZeroStdFilter(),
                        on_discard=counted(lambda group, reason: None, None, discarded))
    worker = AsyncRolloutWorker(NumberedSource(), buffer, n_samples_per_prompt=N, max_in_flight=2 * N,
                                generate_sample=same_reward)

    async def main():
        worker.start()
        assert await worker.take(1, 0, timeout=0.5) == []  # nothing ever reaches the trainer
        line = worker_progress(cfg, worker, discarded)
        before = worker.metrics()["rollout/groups_produced_total"]
        await worker.stop()
        return line, before

    line, produced = asyncio.run(main())
    filtered = discarded["filtered"]
    assert filtered >= 3 and set(discarded) == {"filtered"}
    assert line.startswith(f"{filtered} groups finished since the worker started, dropped: {filtered} by "
                           "rollout.dynamic_filter = 'zero_std'; ")
    assert line.endswith("trajectories generating") and produced >= filtered  # no window was reset by the read


def test_a_line_names_each_reason_it_dropped_for():
    cfg = VerstConfig.model_validate({"schedule": "fully_async", "buffer": {"max_staleness": 1}})
    discarded = collections.Counter({"aborted": 2, "stale": 5})

    class Worker:
        def progress(self):
            return {"groups_finished": 9, "generating": 16}

    assert worker_progress(cfg, Worker(), discarded) == (
        "9 groups finished since the worker started, dropped: 2 aborted (an error or an abort in a sample), "
        "5 stale (over buffer.max_staleness = 1); 16 trajectories generating")
    assert worker_progress(cfg, Worker(), collections.Counter()).startswith("9 groups finished since the worker "
                                                                            "started, none dropped; ")


def test_the_driver_logs_the_workers_progress_while_it_waits(caplog):
    from verst.config import FaultConfig, batch_plan
    from verst.orchestration import TrainBatchRef
    from verst.run.guard import Guard
    from verst.run.lanes import Lane
    from verst.run.rollouts import Rollouts

    class Manager:
        """Nothing for the first take, one group for the second, then the step's groups."""

        def __init__(self):
            self.takes = []

        def take_batch(self, n, version, timeout):
            self.takes.append(n)
            held = (0, 1, n)[min(len(self.takes), 3) - 1]
            return (TrainBatchRef("batch", n), {}) if held == n else (TrainBatchRef([], held), None)

        def progress(self):
            return "12 groups finished since the worker started, dropped: 12 by rollout.dynamic_filter = 'zero_std'"

    cfg = VerstConfig.model_validate({"schedule": "fully_async", "rollout": {"batch_size": 2,
                                                                             "n_samples_per_prompt": 2},
                                      "trainer": {"global_batch_size": 4}})
    lane = Lane(cfg, batch_plan(cfg), Manager())
    rollouts = Rollouts([lane], "http://router", Guard(FaultConfig()))
    with caplog.at_level("INFO", logger="verst.run.rollouts"):
        batch, metrics = asyncio.run(rollouts.take(lane, 0))
    assert batch.groups == "batch" and lane.rollout.takes == [2, 2, 2]
    assert "no finished group for 30 s (have 0/2); waiting: 12 groups finished since the worker started, " \
           "dropped: 12 by rollout.dynamic_filter = 'zero_std'" in caplog.text
    assert caplog.text.count("no finished group") == 1  # the second take brought one
