"""Fully async: a background worker keeps `rollout.max_in_flight` trajectories generating across
training steps; each step takes whichever groups have finished from the bounded buffer, which drops
groups older than `buffer.max_staleness` versions. Needs disaggregated placement. Multi-LoRA: every
adapter's worker generates at once on the shared engines; the train steps take the adapters in turn.
"""

from __future__ import annotations

import time
from typing import Any

from verst.config import VerstConfig
from verst.run import RunOpener, open_rl_run


async def run_fully_async(cfg: VerstConfig, restarts: int = 0, open_run: RunOpener = open_rl_run) -> dict[str, Any]:
    async with open_run(cfg, restarts) as run:
        await run.begin()  # the step-0 evaluation, while the first rollouts generate
        async with run.generating():
            for lane in run.turns():  # multi-LoRA: the adapters in turn, each from its own buffer
                start = time.perf_counter()
                batch, rollout_metrics = await run.take(lane)
                async for step_metrics in run.train(batch, lane):  # the groups of one step
                    # push (generation pauses for the push only), log, evaluate, save
                    await run.end_step({**rollout_metrics, **step_metrics}, start, lane)
        return await run.finish()
