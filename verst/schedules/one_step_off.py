"""One-step-off: generation of batch k+1 runs while the trainer trains on batch k.

Batch k+1 starts on the weights of step k-1, so it is at most one version stale; the weight push
pauses it (sync.pause_mode) and it continues on the new weights, recording both versions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from verst.config import VerstConfig
from verst.schedules.run_start import open_rl_run


async def run_one_step_off(cfg: VerstConfig, restarts: int = 0) -> dict[str, Any]:
    async with open_rl_run(cfg, restarts) as run:
        await run.begin()  # the step-0 evaluation, while the first rollouts generate
        if run.first_rollout < cfg.rollout.num_rollouts:  # a run resumed at its end has none to make
            next_batch = asyncio.create_task(run.generate(run.first_rollout))
        for rollout_id in range(run.first_rollout, cfg.rollout.num_rollouts):
            start = time.perf_counter()
            batch, rollout_metrics = await next_batch
            wait_s = time.perf_counter() - start
            if rollout_id + 1 < cfg.rollout.num_rollouts:
                next_batch = asyncio.create_task(run.generate(rollout_id + 1))  # overlaps the training below
            async for step_metrics in run.train(batch):
                metrics = {**rollout_metrics, **step_metrics, "perf/trainer_wait_s": wait_s}
                metrics.update(await run.sync_weights())
                await run.log(metrics, start)
                if run.eval_due():
                    await run.start_evaluation()  # overlaps the next step
                await run.checkpoint_if_due()
                start, rollout_metrics, wait_s = time.perf_counter(), {}, 0.0
        await run.evaluate_last_version()
        return run.finish()
