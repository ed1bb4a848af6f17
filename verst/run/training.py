"""The trainer ranks as an RL run's loops use them: the optimizer steps on one rollout batch, each run on
every rank next to the model (`verst.trainer.rl_steps`), and, colocated, the engines' device memory given
back around each step.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from verst.orchestration import EngineMemory, TrainBatchRef
from verst.run.guard import Guard
from verst.run.lanes import Lane
from verst.trainer.backend import TrainerRanks
from verst.trainer.rl_steps import train_adapter_step, train_rollout_step


class DeviceShare:
    """Colocated placement: trainer and engines share the devices, so the engines release their memory
    while the trainer steps (after an evaluation running on them, `settle`, has finished). Disaggregated
    (`engines` None): nothing to share."""

    def __init__(self, engines: EngineMemory | None, settle: Callable[[], Awaitable[None]]):
        self.engines, self.settle = engines, settle

    @contextlib.asynccontextmanager
    async def trainer_turn(self) -> AsyncIterator[None]:
        if self.engines is None:
            yield
            return
        await self.settle()
        await asyncio.to_thread(self.engines.release_memory)
        try:
            yield
        finally:
            await asyncio.to_thread(self.engines.resume_memory)


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
