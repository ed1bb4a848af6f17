"""Fully async: a background worker keeps `rollout.max_in_flight` trajectories generating across
training steps; each step takes whichever groups have finished from the bounded buffer, which drops
groups older than `buffer.max_staleness` versions. Needs disaggregated placement.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from verst.config import VerstConfig
from verst.recipes.rl import open_rl_run


async def run_fully_async(cfg: VerstConfig) -> dict[str, Any]:
    async with open_rl_run(cfg) as run:
        run.logger.log({**run.startup_metrics, **await run.evaluate()}, step=0)
        await asyncio.to_thread(run.rollout.start_async)
        try:
            for _ in range(run.plan.total_train_steps):
                start = time.perf_counter()
                groups, metrics = await run.take()
                async for step_metrics in run.train(groups):  # the groups of one step
                    metrics.update(step_metrics)
                metrics.update(await run.sync_weights())  # generation pauses only for the push itself
                if run.eval_due():
                    metrics.update(await run.evaluate())
                await run.log(metrics, start)
        finally:
            await asyncio.to_thread(run.rollout.stop_async)
        if not run.eval_history or run.eval_history[-1][0] != run.version:
            run.logger.log(await run.evaluate(), step=run.version)
        return run.finish()
