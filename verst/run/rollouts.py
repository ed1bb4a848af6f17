"""The rollout side of an RL run as its loops see it: one lane per trained policy, each fed by its rollout
manager: whole rollout batches (sync, one-step-off) or finished groups taken from the buffer (fully async),
and the rollout side's state in a checkpoint.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

from verst.orchestration import TrainBatchRef
from verst.run.guard import Guard
from verst.run.lanes import Lane, rollout_ids, turns

TAKE_TIMEOUT_S = 30.0  # fully async: log and wait again when no group arrived for this long
log = logging.getLogger(__name__)


class Rollouts:
    """`lanes`: one per trained policy (multi-LoRA: per adapter), each with its rollout manager;
    `router_url`: where evaluations and probes reach the engines (the router, or the one engine)."""

    def __init__(self, lanes: list[Lane], router_url: str, guard: Guard):
        self.lanes, self.router_url, self.guard = lanes, router_url, guard

    @property
    def multi_lora(self) -> bool:
        return self.lanes[0].adapter is not None

    def rollout_turns(self) -> Iterator[tuple[int, Lane]]:
        """Sync: each rollout batch left, with its lane (multi-LoRA: every adapter's batch k, then k + 1)."""
        return rollout_ids(self.lanes)

    def turns(self) -> Iterator[Lane]:
        """Fully async: the lane of each train step left (multi-LoRA: the adapters in turn)."""
        return turns(self.lanes)

    async def generate(self, rollout_id: int, lane: Lane, version: int) -> tuple[TrainBatchRef, dict[str, float]]:
        """One rollout batch (its groups stay on the rollout side until the ranks fetch them) and its metrics."""
        return await self.guard(f"rollout step {rollout_id}", "rollout_timeout_s",
                                asyncio.to_thread(lane.rollout.generate_train_batch, rollout_id, version))

    async def take(self, lane: Lane, version: int) -> tuple[TrainBatchRef, dict[str, float]]:
        """Fully async: one train step's groups from `lane`'s buffer (stale ones are dropped there)."""
        return await self.guard(f"taking the groups of train step {version + 1}", "rollout_timeout_s",
                                self._take(lane, version))

    async def _take(self, lane: Lane, version: int) -> tuple[TrainBatchRef, dict[str, float]]:
        start, need, have = time.perf_counter(), lane.plan.groups_per_train_step, 0
        while True:  # one call a step when the groups are ready
            batch, metrics = await asyncio.to_thread(lane.rollout.take_batch, need, version, TAKE_TIMEOUT_S)
            if metrics is not None:
                break
            if batch.num_groups == have:
                progress = await asyncio.to_thread(lane.rollout.progress)
                log.info("no finished group for %.0f s (have %d/%d); waiting: %s", TAKE_TIMEOUT_S, have, need,
                         progress)
            have = batch.num_groups
        metrics["perf/trainer_wait_s"] = time.perf_counter() - start
        return batch, metrics

    @contextlib.asynccontextmanager
    async def generating(self) -> AsyncIterator[None]:
        """Fully async: every lane's background worker generates inside the block."""
        for lane in self.lanes:
            await asyncio.to_thread(lane.rollout.start_async)
        try:
            yield
        finally:
            for lane in self.lanes:
                await asyncio.to_thread(lane.rollout.stop_async)

    async def save(self, directory: Path) -> dict[str, int] | dict[str, dict[str, int]]:
        """Every lane's rollout side (source, buffer, worker) into `directory`; the counts saved (multi-LoRA:
        by adapter)."""
        counts = await asyncio.gather(*(asyncio.to_thread(lane.rollout.save_state, str(directory / lane.rollout_file))
                                        for lane in self.lanes))
        return counts[0] if not self.multi_lora else {lane.adapter: c for lane, c in zip(self.lanes, counts)}

    async def load(self, directory: Path) -> None:
        """Restore what `save` wrote, before generation starts."""
        for lane in self.lanes:
            await asyncio.to_thread(lane.rollout.load_state, str(directory / lane.rollout_file))
