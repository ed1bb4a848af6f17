"""The trainer ranks as an RL run's loops use them: the optimizer steps on one rollout batch, each run on
every rank next to the model (`verst.trainer.rl_steps`), and, colocated, the engines' device memory given
back around each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol

from verst.orchestration import EngineMemory, TrainBatchRef
from verst.run.guard import Guard
from verst.run.lanes import Lane
from verst.trainer.backend import TrainerRanks
from verst.trainer.rl_steps import train_adapter_step, train_rollout_step


class EngineRecovery(Protocol):
    """What the device share asks of the engine supervisor (`EngineSupervisor`) when an engine fails a memory call."""

    @property
    def restarts_engines(self) -> bool: ...

    async def check_now(self) -> None: ...

    def replaced_since(self, moment: float) -> set[int]: ...


class DeviceShare:
    """Colocated placement: trainer and engines share the devices, so the engines release their memory
    while the trainer steps (after an evaluation running on them, `settle`, has finished). Disaggregated
    (`engines` None): nothing to share, but with `takes_engine_cores` (on CPU, the sync schedule gives each side
    every core in turn) an evaluation on the engines still ends first: both at once would ask twice the cores.

    An engine that fails a memory call because it died is restarted by `recovery` (the engine supervisor) and
    the step goes on: restarted before the step, its new server releases its memory too; restarted during the
    step, its new server holds its memory already and is not resumed. Any other failure is raised."""

    def __init__(self, engines: EngineMemory | None, settle: Callable[[], Awaitable[None]],
                 recovery: EngineRecovery | None = None, takes_engine_cores: bool = False):
        self.engines, self.settle, self.recovery = engines, settle, recovery
        self.takes_engine_cores = takes_engine_cores

    @contextlib.asynccontextmanager
    async def trainer_turn(self) -> AsyncIterator[None]:
        if self.engines is None:
            if self.takes_engine_cores:
                await self.settle()
            yield
            return
        await self.settle()
        released = await self._release(list(range(len(self.engines.urls))))
        try:
            yield
        finally:
            replaced = {i for i, at in released.items() if i in self._replaced_since(at)}
            resumed = await asyncio.to_thread(self.engines.resume_memory, sorted(set(released) - replaced))
            await self._restarted(_failures(resumed), released)

    async def _release(self, engines: list[int]) -> dict[int, float]:
        """The engines' memory released; by engine, when (perf_counter). An engine found dead on the way is
        restarted, and its new server releases its memory too."""
        started = time.perf_counter()
        results = await asyncio.to_thread(self.engines.release_memory, engines)
        released = {i: started for i, result in results.items() if result is True}
        restarted = await self._restarted(_failures(results), dict.fromkeys(engines, started))
        if restarted:
            again = time.perf_counter()
            failures = _failures(await asyncio.to_thread(self.engines.release_memory, restarted))
            if failures:
                raise next(iter(failures.values()))
            released.update(dict.fromkeys(restarted, again))
        return released

    async def _restarted(self, failures: dict[int, BaseException], since: dict[int, float]) -> list[int]:
        """The failed engines the supervisor, probing every engine now, has restarted since `since[engine]`;
        the first failure of any other engine is raised."""
        if not failures:
            return []
        if self.recovery is None or not self.recovery.restarts_engines:
            raise next(iter(failures.values()))
        await self.recovery.check_now()  # a dead engine is restarted here (or the run is stopped)
        restarted = [i for i in failures if i in self.recovery.replaced_since(since[i])]
        left = [error for i, error in failures.items() if i not in restarted]
        if left:
            raise left[0]
        return sorted(restarted)

    def _replaced_since(self, moment: float) -> set[int]:
        return self.recovery.replaced_since(moment) if self.recovery is not None else set()


def _failures(results: dict[int, Any]) -> dict[int, BaseException]:
    return {index: result for index, result in results.items() if isinstance(result, BaseException)}


class TrainerGroup:
    """`ranks`: the trainer rank actors (or one in-process rank); `started_at`: the run's start (wall clock),
    against which the ranks' start-up is measured at the first step."""

    def __init__(self, ranks: TrainerRanks, guard: Guard, device_share: DeviceShare, started_at: float):
        self.ranks, self.guard, self.device_share, self.started_at = ranks, guard, device_share, started_at

    async def train(self, batch: TrainBatchRef, lane: Lane, version: int) -> AsyncIterator[dict[str, float]]:
        """The optimizer steps on one rollout batch, `lane.plan.groups_per_train_step` groups each, from
        trainer version `version` on, yielding each step's metrics (the caller pushes weights in between).
        The ranks fetch the batch at its first step and keep it, with the old policy's logprobs taken before
        that step when it gets more than one. Multi-LoRA: the steps train `lane`'s adapter, with its config."""
        step_fn, args = (train_rollout_step, ()) if lane.adapter is None else (train_adapter_step, (lane.adapter,))
        for first in range(0, batch.num_groups, lane.plan.groups_per_train_step):
            groups = batch.groups if first == 0 else None  # later steps use the ranks' copy
            async with self.device_share.trainer_turn():
                start = time.perf_counter()
                # Tensors are built, and advantages computed, next to the model.
                metrics = await self.guard(f"train step {version + 1}", "step_timeout_s", asyncio.to_thread(
                    self.on_ranks, step_fn, *args, groups, first, lane.cfg, version))
                metrics["time/train_s"] = time.perf_counter() - start  # with the trips to the ranks
            if version == 0:
                metrics.update(self.startup_metrics())
            version += 1
            yield metrics

    def on_ranks(self, step: Callable[..., Any], *args: Any) -> Any:
        """`step(backend, *args)` next to the model, on every rank (a collective step); rank 0's result."""
        return self.ranks.apply(step, *args)[0]

    def startup_metrics(self) -> dict[str, float]:
        """`time/startup/trainer_s`: from the run's start until the last rank had built its backend; nothing
        for a backend without rank infos (in this process)."""
        infos = self.ranks.infos
        if not infos:
            return {}
        return {"time/startup/trainer_s": max(info["ready_at"] for info in infos) - self.started_at}
