"""Held-out evaluation of an agent: one greedy episode (temperature 0) per prompt through the session
server, with the run's generate fn, agent fn and reward fn; `eval/success` is the solved fraction.

Single-turn greedy scoring (greedy.py) cannot measure a tool-using task: the first reply is a tool call.
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Sequence
from typing import Any

from verst.config import SamplingConfig, VerstConfig
from verst.eval.skip import MixedVersionError, version_metrics
from verst.rewards import compute_rewards
from verst.types import Sample, Status

FINISHED = (Status.COMPLETED, Status.TRUNCATED)


async def evaluate_agentic(
    cfg: VerstConfig,
    engine: Any,
    tokenizer: Any,
    prompts: Sequence[Sample],
    *,
    expect_version: str | None = None,
    concurrency: int = 64,
) -> dict[str, float]:
    """`eval/` metrics of one greedy episode per prompt (`cfg.rollout.generate_fn` with `agent_fn`).

    `engine` is an EngineClient (one engine or a router). Every episode counts: one whose agent
    raised or whose reward failed scores 0 and is counted in `eval/aborted` / `eval/reward_failures`
    (all of them failing raises, with the first reason). With `expect_version`, every engine reply of
    every episode must carry that weight version, else MixedVersionError.
    """
    from verst.rollout import RolloutContext, generate_and_reward  # same layer; imported when used

    if cfg.rollout.agent_fn is None:
        raise ValueError("agentic evaluation needs rollout.agent_fn (and an agentic rollout.generate_fn)")
    start = time.perf_counter()
    rollout = cfg.rollout.model_copy(update={
        "sampling": SamplingConfig(temperature=0.0),
        "max_response_tokens": cfg.eval.max_response_tokens or cfg.rollout.max_response_tokens,
        "concurrency": concurrency,
        "dynamic_filter": None,
        "n_samples_per_prompt": 1,  # every episode is its own group (a `group` sandbox lifetime closes at its end)
    })
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, rollout=rollout, data=cfg.data, reward=cfg.reward,
                         sandbox=cfg.sandbox)
    samples = [Sample(prompt=p.prompt, label=p.label, metadata=dict(p.metadata), index=i, group_index=i)
               for i, p in enumerate(prompts)]
    try:
        samples = list(await asyncio.gather(*(generate_and_reward(ctx, s) for s in samples)))
        if cfg.reward.group:  # every episode is its own group of one
            await compute_rewards([s for s in samples if s.status in FINISHED], ctx.reward_fn, group=True,
                                  key=cfg.reward.key)
    finally:
        await ctx.aclose()
    check_versions(samples, expect_version)
    metrics = episode_metrics(samples, cfg.reward.key)
    if expect_version is not None:
        metrics |= version_metrics([s.weight_versions for s in samples])
    metrics["time/eval_s"] = time.perf_counter() - start
    return metrics


def score_key(cfg: VerstConfig) -> str:
    """The held-out score of a run: greedy agent success for a tool-using task (`rollout.agent_fn`),
    whose first reply is a tool call, else single-turn greedy accuracy."""
    return "eval/success" if cfg.rollout.agent_fn else "eval/accuracy"


SCORE_WORDS = {"eval/success": "agent success", "eval/accuracy": "accuracy"}  # score_key's keys, as logs say them


def check_versions(samples: Sequence[Sample], expect_version: str | None) -> None:
    """A score must name its weights: every engine reply of every episode came from `expect_version`."""
    if expect_version is None:
        return
    versions = sorted({v for s in samples for v in s.weight_versions})
    if versions and versions != [expect_version]:
        raise MixedVersionError(f"agentic evaluation expected weight version {expect_version!r} on every reply, "
                                f"got versions {versions}")


def episode_metrics(samples: Sequence[Sample], key: str | None = None) -> dict[str, float]:
    """Success over every episode, and how the episodes went (turns, tool calls, lengths, endings)."""
    if not samples:
        raise ValueError("agentic evaluation got no prompts")
    scored = [s for s in samples if s.status in FINISHED and s.reward is not None]
    if not scored:
        first = next((s.metadata.get("generate_error") or s.metadata.get("reward_error") for s in samples), None)
        raise RuntimeError(f"agentic evaluation: none of {len(samples)} episodes finished and scored; "
                           f"first reason: {first!r}")
    n = len(samples)
    metrics = {
        "eval/success": sum(s.reward_value(key) for s in scored) / n,
        "eval/n_prompts": float(n),
        "eval/aborted": float(sum(s.status is Status.ABORTED for s in samples)),
        "eval/reward_failures": float(sum(s.status is Status.FAILED for s in samples)),
        "eval/truncated_ratio": sum(s.status is Status.TRUNCATED for s in samples) / n,
        "eval/response_length": statistics.fmean(s.response_length for s in samples),
        "eval/turns_mean": statistics.fmean(len(s.metadata.get("turns", [])) for s in samples),
    }
    calls = [s.metadata["tool_calls"] for s in samples if isinstance(s.metadata.get("tool_calls"), int)]
    if calls:
        metrics["eval/tool_calls_mean"] = statistics.fmean(calls)
    return metrics


def evaluate_agentic_local(
    cfg: VerstConfig, model: Any, tokenizer: Any, prompts: Sequence[Sample], *, max_running_requests: int = 64
) -> dict[str, float]:
    """`evaluate_agentic` over an in-process embedded engine serving `model` (a Hugging Face model in
    memory), for loops without rollout engines (SFT). A fresh engine per call: no prefix cache survives
    a weight change."""
    from verst.engine.core import EngineConfig, EngineCore
    from verst.engine.process import BackgroundServer
    from verst.inference_client.client import EngineClient

    core = EngineCore(model, tokenizer, EngineConfig(max_running_requests=max_running_requests))
    server = BackgroundServer(core).start()
    try:
        async def run() -> dict[str, float]:
            async with EngineClient(server.url) as client:
                return await evaluate_agentic(cfg, client, tokenizer, prompts, concurrency=max_running_requests)

        return asyncio.run(run())
    finally:
        server.stop()
