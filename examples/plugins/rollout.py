"""A rollout fn (`rollout.rollout_fn`): `async (ctx, n_groups) -> RolloutBatch` owns data, batching and
rewards for one rollout step. This one draws exactly `n_groups` prompts, generates every sample with the
configured generate fn, scores them and returns them all: no over-sampling, no filter.

    [rollout]
    rollout_fn = "examples.plugins.rollout:one_round"
"""

from __future__ import annotations

import asyncio
import time

from verst.rewards import compute_rewards
from verst.rollout.plugins import RolloutBatch, RolloutContext


async def one_round(ctx: RolloutContext, n_groups: int) -> RolloutBatch:
    start = time.perf_counter()
    groups = ctx.source.next_groups(n_groups, ctx.rollout.n_samples_per_prompt)
    samples = [s for g in groups for s in g]
    samples = await asyncio.gather(*(ctx.generate_fn(ctx, s) for s in samples))
    for s in samples:
        s.validate()  # the generate fn kept the Sample's length invariants
    metrics = await compute_rewards(samples, ctx.reward_fn, group=ctx.reward.group, key=ctx.reward.key)
    n = ctx.rollout.n_samples_per_prompt
    groups = [list(samples[i : i + n]) for i in range(0, len(samples), n)]
    return RolloutBatch(groups, {**metrics, "time/rollout_fn_s": time.perf_counter() - start})
