"""Fully async: a background worker keeps `rollout.max_in_flight` trajectories generating across
training steps; each step takes whichever groups have finished from the bounded buffer, which drops
groups older than `buffer.max_staleness` versions. Needs disaggregated placement.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from verst.config import VerstConfig
from verst.schedules.run import open_rl_run


async def run_fully_async(cfg: VerstConfig, restarts: int = 0) -> dict[str, Any]:
    async with open_rl_run(cfg, restarts) as run:
        await run.begin()  # the step-0 evaluation, while the first rollouts generate
        await asyncio.to_thread(run.rollout.start_async)
        try:
            for _ in range(run.version, run.plan.total_train_steps):
                start = time.perf_counter()
                batch, metrics = await run.take()
                async for step_metrics in run.train(batch):  # the groups of one step
                    metrics.update(step_metrics)
                metrics.update(await run.sync_weights())  # generation pauses only for the push itself
                await run.log(metrics, start)
                if run.eval_due():
                    await run.start_evaluation()  # overlaps the next step
                await run.checkpoint_if_due()
        finally:
            await asyncio.to_thread(run.rollout.stop_async)
        await run.evaluate_last_version()
        return run.finish()
