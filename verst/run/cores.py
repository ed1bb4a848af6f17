"""The run's core budget on CPU: which cores each trainer rank and each policy engine runs on, with how many
torch intra-op threads, so that every core is busy and no two busy processes share one.

A side that runs alone (the sync schedule generates, then trains) gets every core in turn: the trainer ranks
split all of them, and so do the engines, since the two never compute at once. Schedules that generate while
the trainer steps (one-step-off, fully async) split the cores between the two sides, each pinned to its own,
in proportion to the work each side measured (its busy seconds times its cores): a side that waits gives a
core to the one it waits for. When no split helps (the engines already on one core and mostly idle, the
trainer the slower side), the trainer is lent the engines' cores too, its threads on every core, and keeps
them only if steps measured that way end sooner. `cluster.trainer_threads` / `cluster.engine_threads` set the threads and keep
the planned cores. The driver and rollout managers are not pinned (they mostly wait), nor are teacher and
evaluation engines (one thread each).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Protocol

from verst.config import VerstConfig
from verst.config.core_rules import cores_exist
from verst.config.registries import ENGINE_KINDS
from verst.types.cores import CoreShare, core_ranges, usable_cores

log = logging.getLogger(__name__)

# The schedules whose engines generate while the trainer steps.
CONCURRENT_SCHEDULES = ("one_step_off", "fully_async")
# A re-split must promise at least this much shorter step (the busier side's seconds) to be made.
MIN_GAIN = 0.1
# Steps measured before the first re-split, and between two re-splits.
SETTLE_STEPS = 2
# The engines' idle share from which the trainer is tried on their cores too.
LEND_IDLE = 0.5


@dataclasses.dataclass(frozen=True)
class CorePlan:
    """The shares by trainer rank and by policy engine; `concurrent`: the two sides compute at once; `lent`:
    the trainer's shares cover the engines' cores too (it computes on them while they idle)."""

    trainer: tuple[CoreShare, ...]
    engines: tuple[CoreShare, ...]
    concurrent: bool
    lent: bool = False

    @property
    def trainer_cores(self) -> tuple[int, ...]:
        return _union(self.trainer)

    @property
    def engine_cores(self) -> tuple[int, ...]:
        return _union(self.engines)

    def metrics(self) -> dict[str, float]:
        """The threads and cores of each side (threads summed over its processes)."""
        return {"perf/trainer_threads": float(sum(s.threads for s in self.trainer)),
                "perf/engine_threads": float(sum(s.threads for s in self.engines)),
                "perf/trainer_cores": float(len(self.trainer_cores)),
                "perf/engine_cores": float(len(self.engine_cores))}

    def describe(self) -> str:
        def side(shares: tuple[CoreShare, ...], what: str) -> str:
            threads = {s.threads for s in shares}
            each = f"{threads.pop()} thread(s) each" if len(threads) == 1 else "threads " + \
                ",".join(str(s.threads) for s in shares)
            return f"{len(shares)} {what} on cores {core_ranges(_union(shares))}, {each}"

        how = "split while both compute" if self.concurrent else "each side alone on every core"
        if self.lent:
            how += "; the trainer lent the engines' cores"
        return f"{side(self.trainer, 'trainer rank(s)')}; {side(self.engines, 'engine(s)')} ({how})"


def split_among(cores: tuple[int, ...], processes: int, threads: int | None = None) -> tuple[CoreShare, ...]:
    """`cores` divided among `processes` in contiguous runs as even as they go, each process with one thread
    per core (or `threads`); with fewer cores than processes, the processes take the cores in turn, one
    thread each."""
    if processes < 1:
        return ()
    if processes >= len(cores):
        return tuple(CoreShare((cores[i % len(cores)],), threads or 1) for i in range(processes))
    base, extra = divmod(len(cores), processes)
    shares, start = [], 0
    for i in range(processes):
        size = base + (1 if i < extra else 0)
        chunk = cores[start:start + size]
        shares.append(CoreShare(chunk, threads or len(chunk)))
        start += size
    return tuple(shares)


@dataclasses.dataclass(frozen=True)
class CoreLayout:
    """What a core plan is made for: the `cores` shared, `trainer_ranks` ranks and `engines` policy engines,
    whether the two sides compute at once (`concurrent`), and threads fixed by the config (None: one per core)."""

    cores: tuple[int, ...]
    trainer_ranks: int
    engines: int
    concurrent: bool
    trainer_threads: int | None = None
    engine_threads: int | None = None

    def __post_init__(self) -> None:
        if not self.cores:
            raise ValueError("the core budget needs at least one core")

    def plan(self, trainer_cores: int | None = None, lend: bool = False) -> CorePlan:
        """Alone: each side splits every core among its processes. Concurrent: the first `trainer_cores` cores
        (default: half) are the trainer's and the rest the engines', each side keeping at least one; `lend`:
        the trainer splits every core, the engines keeping theirs."""
        lend = lend and self.concurrent and len(self.cores) > 1
        if not self.concurrent or len(self.cores) == 1:
            ours = theirs = self.cores
        else:
            k = len(self.cores) // 2 if trainer_cores is None else trainer_cores
            k = min(max(k, 1), len(self.cores) - 1)
            ours, theirs = self.cores[:k], self.cores[k:]
        return CorePlan(split_among(self.cores if lend else ours, self.trainer_ranks, self.trainer_threads),
                        split_among(theirs, self.engines, self.engine_threads), self.concurrent, lend)


def core_layout(cfg: VerstConfig, device: str) -> CoreLayout | None:
    """The run's core layout: on the CPU of a local machine (`cluster.ray_address` unset), the first
    `cluster.cores` of the cores this process may run on (all by default); None on a GPU or a Ray cluster,
    whose processes keep one thread each. The engines are counted when their kind takes its share;
    `algorithm.true_on_policy` trains on one thread (the engine scores on one)."""
    if device != "cpu" or cfg.cluster.ray_address:
        return None
    usable = usable_cores()
    cores_exist(cfg.cluster.cores, usable)
    takes_share = ENGINE_KINDS.entry(cfg.cluster.engine).cpu_share
    one_thread = 1 if cfg.algorithm.true_on_policy else None
    return CoreLayout(usable[:cfg.cluster.cores] if cfg.cluster.cores else usable, cfg.cluster.trainer_ranks,
                      cfg.cluster.num_engines if takes_share else 0, concurrent=cfg.schedule in CONCURRENT_SCHEDULES,
                      trainer_threads=cfg.cluster.trainer_threads or one_thread,
                      engine_threads=cfg.cluster.engine_threads)


def trainer_alone(cfg: VerstConfig, device: str) -> tuple[CoreShare, ...] | None:
    """SFT's (and evaluation's) trainer ranks: the trainer alone on the run's cores (None: GPU, Ray cluster)."""
    layout = core_layout(cfg.model_copy(update={"schedule": "sync"}), device)
    return None if layout is None else dataclasses.replace(layout, engines=0).plan().trainer


def balanced_trainer_cores(total: int, trainer_work: float, engine_work: float) -> int:
    """The trainer's cores out of `total` in proportion to the two sides' work (core-seconds per step), each
    side keeping at least one."""
    if total < 2:
        return total
    share = trainer_work / (trainer_work + engine_work) if trainer_work + engine_work > 0 else 0.5
    return min(max(round(total * share), 1), total - 1)


def busier_seconds(trainer_work: float, engine_work: float, trainer_cores: int, total: int) -> float:
    """The longer side's seconds per step when the trainer has `trainer_cores` of `total` cores (work
    scaling with cores)."""
    return max(trainer_work / trainer_cores, engine_work / (total - trainer_cores))


class RankCores(Protocol):
    def set_cores(self, shares: list[CoreShare]) -> None:
        """Rank i takes `shares[i]`."""
        ...


class EngineCores(Protocol):
    async def set_cores(self, shares: list[CoreShare]) -> None:
        """Engine i takes `shares[i]`."""
        ...


class CoreBudget:
    """The run's core plan, applied to its trainer ranks and policy engines, re-split between the two sides
    from each step's measured work while both compute at once (`observe` at every step's end), and the
    engines' cores lent to the trainer while that makes steps shorter (tried once, kept if measured so)."""

    def __init__(self, layout: CoreLayout, ranks: RankCores, engines: EngineCores | None):
        self.layout, self.ranks, self.engines = layout, ranks, engines
        self.plan = layout.plan()
        self._trainer_work: list[float] = []
        self._engine_work: list[float] = []
        self._step_s: list[float] = []
        self._lend: Lending | None = None  # the trial of lent cores, once begun
        self._reapply = False
        self.resplits = 0

    def engine_replaced(self) -> None:
        """A restarted engine starts with its launch share: the next step's end gives it the current one."""
        self._reapply = True

    async def observe(self, metrics: dict[str, float]) -> None:
        """After a step (its metrics): record each side's work (busy seconds times its cores) and re-split the
        cores when the measured work says a different split ends steps sooner."""
        if self._reapply and self.engines is not None:
            self._reapply = False
            await self.engines.set_cores(list(self.plan.engines))
        trainer_s, step_s = metrics.get("time/train_s"), metrics.get("perf/step_time_s")
        idle = metrics.get("perf/engine_idle_fraction")
        if self.layout.concurrent and None not in (trainer_s, step_s, idle):
            self._trainer_work.append(trainer_s * len(self.plan.trainer_cores))
            self._engine_work.append((1.0 - idle) * step_s * len(self.plan.engine_cores))
            self._step_s.append(step_s)
            for kept in (self._trainer_work, self._engine_work, self._step_s):
                del kept[:-SETTLE_STEPS]  # only the last steps are ever read
            if len(self._step_s) >= SETTLE_STEPS:
                await self._next_plan(idle)

    async def _next_plan(self, idle: float) -> None:
        """A lending trial's verdict once it has its steps; else a re-split when one helps; else, once, the
        trial of lending the engines' cores to the trainer when they idle and the trainer is the slower."""
        step_s = sum(self._step_s[-SETTLE_STEPS:]) / SETTLE_STEPS
        if self._lend is not None and self._lend.lent_s is None:
            self._lend.lent_s = step_s
            if not self._lend.kept:
                await self._switch(self._lend.split, "lending the engines' cores made steps no shorter")
            else:
                log.info("cores: the trainer keeps the engines' cores (%.2f s a step, %.2f s without)",
                         step_s, self._lend.split_s)
            return
        if self.plan.lent:
            return
        trainer_work = sum(self._trainer_work[-SETTLE_STEPS:]) / SETTLE_STEPS
        engine_work = sum(self._engine_work[-SETTLE_STEPS:]) / SETTLE_STEPS
        total, now = len(self.layout.cores), len(self.plan.trainer_cores)
        best = balanced_trainer_cores(total, trainer_work, engine_work)
        before, after = (busier_seconds(trainer_work, engine_work, k, total) for k in (now, best))
        if best != now and after <= before * (1 - MIN_GAIN):
            await self._switch(self.layout.plan(best), f"re-split from the measured work (trainer {trainer_work:.1f}, "
                               f"engines {engine_work:.1f} core-seconds a step)")
            self.resplits += 1
        elif self._lend is None and total > 1 and idle >= LEND_IDLE and trainer_work / now > engine_work / (total - now):
            self._lend = Lending(self.plan, step_s)
            await self._switch(self.layout.plan(now, lend=True), f"the engines idle {idle:.0%} of a step: the "
                               "trainer is lent their cores on trial")

    async def _switch(self, plan: CorePlan, why: str) -> None:
        await self.apply(plan)
        log.info("cores %s: %s", why, self.plan.describe())
        self._trainer_work.clear()
        self._engine_work.clear()
        self._step_s.clear()

    async def apply(self, plan: CorePlan | None = None) -> None:
        """Give every rank and engine its share of `plan` (default: the current one)."""
        self.plan = plan or self.plan
        await asyncio.to_thread(self.ranks.set_cores, list(self.plan.trainer))
        if self.engines is not None:
            await self.engines.set_cores(list(self.plan.engines))


@dataclasses.dataclass
class Lending:
    """A trial of the engines' cores lent to the trainer: the `split` plan it left and its seconds a step, and
    once measured, the seconds a step with the cores lent."""

    split: CorePlan
    split_s: float
    lent_s: float | None = None

    @property
    def kept(self) -> bool:
        """Lent steps shorter by at least MIN_GAIN."""
        return self.lent_s is not None and self.lent_s <= self.split_s * (1 - MIN_GAIN)


def _union(shares: tuple[CoreShare, ...]) -> tuple[int, ...]:
    return tuple(sorted({core for share in shares for core in share.cores}))
