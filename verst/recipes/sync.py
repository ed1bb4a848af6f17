"""The synchronous schedule: generate a batch, train on it, push the weights, repeat.

Engines idle while the trainer works and the trainer waits for the slowest trajectory; this is the
baseline the other two schedules are measured against.
"""

from __future__ import annotations

import time
from typing import Any

from verst.config import VerstConfig
from verst.recipes.rl import open_rl_run


async def run_sync(cfg: VerstConfig) -> dict[str, Any]:
    async with open_rl_run(cfg) as run:
        run.logger.log({**run.startup_metrics, **await run.evaluate()}, step=0)
        for rollout_id in range(cfg.rollout.num_rollouts):
            start = time.perf_counter()
            groups, rollout_metrics = await run.generate(rollout_id)
            async for step_metrics in run.train(groups):
                metrics = {**rollout_metrics, **step_metrics}
                metrics.update(await run.sync_weights())
                if run.eval_due():
                    metrics.update(await run.evaluate())
                await run.log(metrics, start)
                start, rollout_metrics = time.perf_counter(), {}
        if not run.eval_history or run.eval_history[-1][0] != run.version:
            run.logger.log(await run.evaluate(), step=run.version)
        return run.finish()
