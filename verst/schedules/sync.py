"""The synchronous schedule: generate a batch, train on it, push the weights, repeat.

Engines idle while the trainer works and the trainer waits for the slowest trajectory; this is the
baseline the other two schedules are measured against.
"""

from __future__ import annotations

import time
from typing import Any

from verst.config import VerstConfig
from verst.run import RunOpener, open_rl_run


async def run_sync(cfg: VerstConfig, restarts: int = 0, open_run: RunOpener = open_rl_run) -> dict[str, Any]:
    async with open_run(cfg, restarts) as run:
        await run.begin()  # the step-0 evaluation, while the first rollouts generate
        for rollout_id, lane in run.rollout_turns():  # multi-LoRA: each adapter's batch k in turn
            start = time.perf_counter()
            batch, rollout_metrics = await run.generate(rollout_id, lane)
            async for step_metrics in run.train(batch, lane):
                await run.end_step({**rollout_metrics, **step_metrics}, start, lane)  # push, log, evaluate, save
                start, rollout_metrics = time.perf_counter(), {}
        return await run.finish()
