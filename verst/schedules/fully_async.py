"""Fully async: a background worker keeps `rollout.max_in_flight` trajectories generating across
training steps; each step takes whichever groups have finished from the bounded buffer, which drops
groups older than `buffer.max_staleness` versions. Needs disaggregated placement. Multi-LoRA: every
adapter's worker generates at once on the shared engines; the train steps take the adapters in turn.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from verst.config import VerstConfig
from verst.schedules.run_start import open_rl_run


async def run_fully_async(cfg: VerstConfig, restarts: int = 0) -> dict[str, Any]:
    async with open_rl_run(cfg, restarts) as run:
        await run.begin()  # the step-0 evaluation, while the first rollouts generate
        await asyncio.to_thread(run.start_async)
        try:
            for lane in run.turns():  # multi-LoRA: the adapters in turn, each from its own buffer
                start = time.perf_counter()
                batch, metrics = await run.take(lane)
                async for step_metrics in run.train(batch, lane):  # the groups of one step
                    metrics.update(step_metrics)
                metrics.update(await run.sync_weights(lane))  # generation pauses only for the push itself
                await run.log(metrics, start, lane)
                if run.eval_due():
                    await run.start_evaluation()  # overlaps the next step
                await run.checkpoint_if_due()
        finally:
            await asyncio.to_thread(run.stop_async)
        await run.evaluate_last_version()
        return run.finish()
