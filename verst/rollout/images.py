"""Image trajectories (model.kind = "diffusion", docs/diffusion.md): the generate fn that asks the diffusion engine
for one image of a prompt's class with each denoising step's latent and log-probability, and the held-out
evaluation that scores fixed seeds with the run's reward and writes them as an image grid.

A denoising step plays a token's part: the sample's tokens are the class id the engine drew, then the step
numbers; its `rollout_logprobs` are the steps' log-probabilities, `latents` the recorded latents.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from verst.config import DiffusionConfig
from verst.monitor.image_grid import eval_grid_path, save_grid, to_pixels
from verst.rewards.compute import compute_rewards
from verst.rollout.generate import mark_aborted
from verst.types import Sample, Status
from verst.types.arrays import decode_array, encode_array

if TYPE_CHECKING:
    from verst.inference_client.images import ImageResult
    from verst.rollout.plugins import RolloutContext

SEED_KEY = "seed"  # metadata: the seed the image was sampled from
EVAL_SEED = 2**40  # held-out images: seeds EVAL_SEED + i, far from the training seeds (base seed + sample index)


def sampler_params(settings: DiffusionConfig) -> dict[str, Any]:
    """The request's sampler settings; the engine echoes them and the client refuses a reply sampled otherwise."""
    return {"num_inference_steps": settings.num_inference_steps, "guidance_scale": settings.guidance_scale,
            "noise_level": settings.noise_level}


def image_seed(ctx: RolloutContext, sample: Sample) -> int:
    """rollout.sampling.seed + the sample's index, else a fresh random seed (each image of a group its own)."""
    base = ctx.rollout.sampling.seed
    return base + sample.index if base is not None else random.randrange(2**62)


async def generate_image(ctx: RolloutContext, sample: Sample) -> Sample:
    """One engine call for one image of the sample's prompt (a class description)."""
    if ctx.diffusion is None:
        raise ValueError("the image generate fn needs the run's [diffusion] settings (model.kind = 'diffusion')")
    if sample.index in ctx.state.stopped:
        return mark_aborted(sample, "the rollout step ended before generation started")
    seed = image_seed(ctx, sample)
    params = {**sampler_params(ctx.diffusion), "sampling_seed": seed}
    rid = ctx.state.new_rid(sample)
    ctx.state.in_flight[rid] = sample.index
    try:
        [result] = await ctx.engine.generate_images(str(sample.prompt), params, rid=rid, return_logprob=True)
    finally:
        ctx.state.in_flight.pop(rid, None)
    sample.metadata[SEED_KEY] = seed
    record_image(sample, result)
    ctx.state.observe_version(result.weight_version)
    return sample.validate()


def record_image(sample: Sample, result: ImageResult) -> None:
    """The reply's class, steps, step log-probabilities and latents on the sample; an aborted one is ABORTED."""
    sample.weight_versions.append(result.weight_version)
    if result.finish_reason.get("type") == "abort":
        mark_aborted(sample, f"aborted by the engine: {result.finish_reason.get('message') or 'no message'}")
        sample.tokens = [result.label]
        return
    if result.latents is None or result.logprobs is None:
        raise ValueError(f"engine reply for rid {result.rid!r} carries no latents or step logprobs "
                         "(the request asked for them with return_logprob)")
    steps = len(result.logprobs)
    sample.tokens = [result.label, *range(steps)]
    sample.response_length = steps
    sample.loss_mask = [1] * steps
    sample.rollout_logprobs = [float(lp) for lp in result.logprobs]
    sample.latents = encode_array(result.latents)
    sample.status = Status.COMPLETED


def sample_pixels(samples: Sequence[Sample]) -> np.ndarray:
    """The samples' images (their last latents), (N, H, W, 3) uint8."""
    return to_pixels(np.stack([decode_array(s.latents, "latents")[-1] for s in samples]))


async def evaluate_images(ctx: RolloutContext, prompts: Sequence[Sample], version: int,
                          run_dir: str | None) -> dict[str, float]:
    """`diffusion.eval_images_per_prompt` images of every held-out prompt from the fixed seeds EVAL_SEED + i (the
    same at every evaluation), scored with the run's reward; each reply must come from weight version `version`.
    `eval/accuracy` is the mean reward (reward.key's component), `eval/reward/<name>` each component's mean; the
    images go to RUN/eval_images/step_<version>.png, a row per prompt."""
    if ctx.diffusion is None:
        raise ValueError("image evaluation needs the run's [diffusion] settings (model.kind = 'diffusion')")
    if not prompts:
        raise ValueError("image evaluation needs held-out prompts: set eval.path or data.test_path")
    per_prompt = ctx.diffusion.eval_images_per_prompt
    params = {**sampler_params(ctx.diffusion), "sampling_seed": EVAL_SEED, "n": per_prompt}
    samples: list[Sample] = []
    for i, prompt in enumerate(prompts):  # one request a prompt: the engine samples its images as one batch
        results = await ctx.engine.generate_images(str(prompt.prompt), params, return_logprob=True)
        for j, result in enumerate(results):
            if result.weight_version != str(version):
                raise ValueError(f"held-out image of prompt {i} came from weight version {result.weight_version}, "
                                 f"not {version}")
            sample = Sample(prompt=prompt.prompt, label=prompt.label, metadata=dict(prompt.metadata),
                            group_index=i, index=len(samples))
            record_image(sample, result)
            sample.metadata[SEED_KEY] = EVAL_SEED + j
            samples.append(sample)
    if any(s.status is not Status.COMPLETED for s in samples):
        raise ValueError(f"{sum(s.status is not Status.COMPLETED for s in samples)} held-out images were aborted")
    await compute_rewards(samples, ctx.reward_fn, group=ctx.reward.group, key=ctx.reward.key)
    scored = [s for s in samples if s.reward is not None]
    if not scored:
        raise ValueError(f"the reward scored none of the {len(samples)} held-out images")
    metrics = {"eval/accuracy": sum(s.reward_value(ctx.reward.key) for s in scored) / len(scored),
               "eval/reward_failures": float(len(samples) - len(scored)), "eval/n_prompts": float(len(prompts))}
    components = sorted({name for s in scored if isinstance(s.reward, dict) for name in s.reward})
    for name in components:
        metrics[f"eval/reward/{name}"] = sum(s.reward[name] for s in scored) / len(scored)
    if run_dir is not None:
        save_grid(sample_pixels(samples), eval_grid_path(run_dir, version), per_prompt)
    return metrics
