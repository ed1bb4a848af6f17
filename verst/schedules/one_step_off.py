"""One-step-off: generation of batch k+1 runs while the trainer trains on batch k.

Batch k+1 starts on the weights of step k-1, so it is at most one version stale; the weight push
pauses it (sync.pause_mode) and it continues on the new weights, recording both versions.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from verst.config import VerstConfig
from verst.run import RunOpener, open_rl_run


async def run_one_step_off(cfg: VerstConfig, restarts: int = 0, open_run: RunOpener = open_rl_run) -> dict[str, Any]:
    async with open_run(cfg, restarts) as run:
        await run.begin()  # the step-0 evaluation, while the first rollouts generate
        last = cfg.rollout.num_rollouts
        if run.first_rollout < last:  # a run resumed at its end has none to make
            next_batch = asyncio.create_task(run.generate(run.first_rollout))
        for rollout_id in range(run.first_rollout, last):
            start = time.perf_counter()
            batch, rollout_metrics = await next_batch
            rollout_metrics["perf/trainer_wait_s"] = time.perf_counter() - start
            if rollout_id + 1 < last:
                next_batch = asyncio.create_task(run.generate(rollout_id + 1))  # overlaps the training below
            async for step_metrics in run.train(batch):
                await run.end_step({**rollout_metrics, **step_metrics}, start)  # push, log, evaluate, save
                start, rollout_metrics = time.perf_counter(), {"perf/trainer_wait_s": 0.0}
        return await run.finish()
