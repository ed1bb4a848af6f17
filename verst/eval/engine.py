"""Greedy generation for evaluation through the rollout engines (or a router in front of them).

A score must name the weights that produced it: every reply's weight version is checked against
the version the caller expects, and a mixed-version evaluation raises instead of reporting.
"""

from __future__ import annotations

import asyncio

from verst.eval.greedy import GenerateFn
from verst.eval.skip import MixedVersionError
from verst.inference_client.client import EngineClient

# The next weight push waits for an evaluation while rollouts (fully async) keep the engines busy: its
# requests go ahead of waiting rollout requests and, on verst's engine, take the slots of running ones
# (priority preemption; SGLang with --enable-priority-scheduling; sglang-router 0.3.2 parses the field as
# an i32, refusing other types).
EVAL_PRIORITY = 1


def engine_greedy_generate(
    url: str, max_new_tokens: int, *, expect_version: str | None = None, concurrency: int | None = None,
    max_batch: int = 1, lora_path: str | None = None,
) -> GenerateFn:
    """A GenerateFn over `/generate` at temperature 0; raises MixedVersionError on a version mismatch.
    `max_batch > 1` sends the prompts as batched requests (an engine, not sglang-router). `concurrency`
    bounds the requests in flight; None sends every prompt at once, for the engines to queue: with a
    bound, a slot freed at the engine waits for the client's next request, so unbounded is faster.
    `lora_path`: the adapter every request names (a LoRA run's policy adapter; None: the base)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"engine_greedy_generate: concurrency must be >= 1 or None, got {concurrency}")

    async def run(prompts: list[list[int]]) -> list[list[int]]:
        semaphore = asyncio.Semaphore(concurrency or max(1, len(prompts)))
        async with EngineClient(url, max_batch=max_batch, lora_path=lora_path) as client:

            async def one(ids: list[int]):
                async with semaphore:
                    return await client.generate(
                        ids, {"temperature": 0.0, "max_new_tokens": max_new_tokens}, return_logprob=False,
                        priority=EVAL_PRIORITY,
                    )

            replies = await asyncio.gather(*(one(p) for p in prompts))
        versions = sorted({r.weight_version for r in replies})
        if expect_version is not None and versions != [expect_version]:
            raise MixedVersionError(
                f"evaluation expected weight version {expect_version!r} on every reply, got versions {versions}"
            )
        return [list(r.output_ids) for r in replies]

    def generate(prompts: list[list[int]]) -> list[list[int]]:
        return asyncio.run(run(prompts))

    return generate
