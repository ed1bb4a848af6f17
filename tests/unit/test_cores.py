"""The run's core budget: shares split among processes, the plan of each schedule, the re-split from measured
work, the layout a config asks for, and a process taking its share (every thread pinned, torch's threads set)."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import pytest

from verst.config import load_config
from verst.run.cores import (
    CoreBudget,
    CoreLayout,
    balanced_trainer_cores,
    core_layout,
    split_among,
    trainer_alone,
)
from verst.types.cores import CoreShare, core_ranges, usable_cores


def test_split_among_processes():
    assert split_among((0, 1, 2, 3), 1) == (CoreShare((0, 1, 2, 3), 4),)
    assert split_among((0, 1, 2, 3, 4), 2) == (CoreShare((0, 1, 2), 3), CoreShare((3, 4), 2))
    assert split_among((0, 1), 3) == (CoreShare((0,), 1), CoreShare((1,), 1), CoreShare((0,), 1))
    assert split_among((0, 1, 2, 3), 2, threads=1) == (CoreShare((0, 1), 1), CoreShare((2, 3), 1))
    assert split_among((0, 1), 0) == ()
    with pytest.raises(ValueError, match="at least one thread"):
        CoreShare((0,), 0)
    assert core_ranges((5, 0, 1, 2, 7, 8)) == "0-2,5,7-8"


def test_a_side_alone_gets_every_core_and_concurrent_sides_split_them():
    alone = CoreLayout((0, 1), trainer_ranks=1, engines=1, concurrent=False).plan()
    assert alone.trainer == (CoreShare((0, 1), 2),) and alone.engines == (CoreShare((0, 1), 2),)
    both = CoreLayout((0, 1), 1, 1, concurrent=True).plan()
    assert both.trainer == (CoreShare((0,), 1),) and both.engines == (CoreShare((1,), 1),)
    assert both.metrics() == {"perf/trainer_threads": 1.0, "perf/engine_threads": 1.0, "perf/trainer_cores": 1.0,
                              "perf/engine_cores": 1.0}
    eight = CoreLayout(tuple(range(8)), 2, 2, concurrent=True)
    assert eight.plan(trainer_cores=6).trainer == (CoreShare((0, 1, 2), 3), CoreShare((3, 4, 5), 3))
    assert eight.plan(trainer_cores=6).engines == (CoreShare((6,), 1), CoreShare((7,), 1))
    assert eight.plan(trainer_cores=8).engine_cores == (7,)  # each side keeps a core
    one = CoreLayout((3,), 1, 2, concurrent=True).plan()  # one core: everything shares it
    assert one.trainer_cores == one.engine_cores == (3,)
    fixed = CoreLayout((0, 1, 2, 3), 1, 1, concurrent=False, trainer_threads=1, engine_threads=3).plan()
    assert fixed.trainer == (CoreShare((0, 1, 2, 3), 1),) and fixed.engines == (CoreShare((0, 1, 2, 3), 3),)
    assert "1 trainer rank(s) on cores 0-3, 1 thread(s) each" in fixed.describe()


def test_balanced_split_follows_the_work():
    assert balanced_trainer_cores(8, trainer_work=6.0, engine_work=2.0) == 6
    assert balanced_trainer_cores(8, trainer_work=100.0, engine_work=0.0) == 7  # the engines keep one
    assert balanced_trainer_cores(2, trainer_work=9.0, engine_work=1.0) == 1
    assert balanced_trainer_cores(1, 1.0, 1.0) == 1


class Ranks:
    def __init__(self):
        self.given = []

    def set_cores(self, shares):
        self.given.append(shares)


class Engines:
    def __init__(self):
        self.given = []

    async def set_cores(self, shares):
        self.given.append(shares)


def step(train_s, step_s, idle):
    return {"time/train_s": train_s, "perf/step_time_s": step_s, "perf/engine_idle_fraction": idle}


def test_the_budget_moves_cores_to_the_side_that_is_waited_for():
    ranks, engines = Ranks(), Engines()
    budget = CoreBudget(CoreLayout(tuple(range(8)), 1, 2, concurrent=True), ranks, engines)

    async def main():
        # The trainer is busy 8 s of a 8 s step on 4 cores (32 core-s); the engines idle 75% (8 core-s).
        for _ in range(2):
            await budget.observe(step(8.0, 8.0, 0.75))

    asyncio.run(main())
    assert budget.resplits == 1
    assert len(budget.plan.trainer_cores) == 6  # 32 / (32 + 8) of 8 cores, rounded
    assert ranks.given[-1] == [CoreShare((0, 1, 2, 3, 4, 5), 6)]
    assert engines.given[-1] == [CoreShare((6,), 1), CoreShare((7,), 1)]


def test_the_budget_keeps_a_split_that_would_gain_little_and_alone_never_resplits():
    ranks, engines = Ranks(), Engines()
    budget = CoreBudget(CoreLayout(tuple(range(8)), 1, 1, concurrent=True), ranks, engines)
    alone = CoreBudget(CoreLayout(tuple(range(8)), 1, 1, concurrent=False), Ranks(), Engines())

    async def main():
        for _ in range(4):
            await budget.observe(step(4.0, 4.4, 0.05))  # balanced: 16 vs 16.7 core-s
            await alone.observe(step(8.0, 8.0, 0.9))

    asyncio.run(main())
    assert budget.resplits == alone.resplits == 0 and not ranks.given and not engines.given


@pytest.mark.parametrize("lent_step_s, kept", [(7.0, True), (9.5, False)])
def test_idle_engines_lend_their_cores_to_the_trainer_while_steps_end_sooner(lent_step_s, kept):
    """Two cores, one each: the trainer busy the whole 10 s step, the engine idle 80%. No split helps (each
    side keeps a core), so the trainer is tried on both cores; kept when its steps end 10% sooner."""
    ranks, engines = Ranks(), Engines()
    budget = CoreBudget(CoreLayout((0, 1), 1, 1, concurrent=True), ranks, engines)

    async def main():
        for _ in range(2):
            await budget.observe(step(10.0, 10.0, 0.8))
        assert budget.plan.lent and ranks.given[-1] == [CoreShare((0, 1), 2)] and engines.given[-1] == [
            CoreShare((1,), 1)]
        assert budget.plan.metrics()["perf/trainer_cores"] == 2.0 and "lent" in budget.plan.describe()
        for _ in range(2):
            await budget.observe(step(lent_step_s - 0.5, lent_step_s, 0.8))
        for _ in range(4):  # tried once: the verdict stands
            await budget.observe(step(lent_step_s - 0.5, lent_step_s, 0.8))

    asyncio.run(main())
    assert budget.plan.lent is kept and budget.resplits == 0
    assert ranks.given[-1] == ([CoreShare((0, 1), 2)] if kept else [CoreShare((0,), 1)])
    assert len(ranks.given) == (1 if kept else 2)


def test_busy_engines_keep_their_cores():
    ranks = Ranks()
    budget = CoreBudget(CoreLayout((0, 1), 1, 1, concurrent=True), ranks, Engines())

    async def main():
        for _ in range(4):
            await budget.observe(step(10.0, 10.0, 0.3))  # the engine busy 70% of the step

    asyncio.run(main())
    assert not budget.plan.lent and not ranks.given


def test_a_restarted_engine_gets_its_share_at_the_next_step():
    engines = Engines()
    budget = CoreBudget(CoreLayout((0, 1), 1, 1, concurrent=True), Ranks(), engines)
    budget.engine_replaced()
    asyncio.run(budget.observe({}))
    assert engines.given == [[CoreShare((1,), 1)]]


def test_the_layout_a_config_asks_for():
    usable = usable_cores()
    fully_async = load_config(None, ["--schedule", "fully_async"])
    layout = core_layout(fully_async, "cpu")
    assert layout.cores == usable and layout.concurrent and layout.engines == fully_async.cluster.num_engines
    assert not core_layout(load_config(None, []), "cpu").concurrent
    assert core_layout(fully_async, "cuda") is None
    assert core_layout(load_config(None, ["--cluster.ray-address", "10.0.0.1:6379"]), "cpu") is None
    assert core_layout(load_config(None, ["--cluster.cores", "1"]), "cpu").cores == usable[:1]
    assert core_layout(load_config(None, ["--algorithm.true-on-policy", "true"]), "cpu").trainer_threads == 1
    vllm = load_config(None, ["--cluster.engine", "vllm", "--sync.transport", "disk"])
    assert core_layout(vllm, "cpu").engines == 0  # vLLM binds its own threads
    assert trainer_alone(fully_async, "cpu") == (CoreShare(usable, len(usable)),)
    with pytest.raises(ValueError, match=rf"cluster.cores = {len(usable) + 1}, but this process may run on"):
        core_layout(load_config(None, ["--cluster.cores", str(len(usable) + 1)]), "cpu")


PIN = """
import os, threading, time, torch
from verst.types.cores import CoreShare, share_taken
first, before = min(os.sched_getaffinity(0)), sorted(os.sched_getaffinity(0))
torch.set_num_threads(2)
stop = threading.Event()
worker = threading.Thread(target=stop.wait)  # started before the share is taken
worker.start()
with share_taken(CoreShare((first,), 3)):
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    print(sorted({tuple(sorted(os.sched_getaffinity(t))) for t in tids}), torch.get_num_threads(), first)
assert sorted(os.sched_getaffinity(worker.native_id)) == before and torch.get_num_threads() == 2
stop.set()
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CPU affinity is Linux's")
def test_taking_a_share_pins_every_thread_and_sets_torch_threads_until_it_is_given_back():
    out = subprocess.run([sys.executable, "-c", PIN], capture_output=True, text=True, timeout=120, check=True).stdout
    masks, threads, first = out.strip().rsplit(" ", 2)
    assert masks == f"[({first},)]" and threads == "3"
