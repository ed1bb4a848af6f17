"""The rollout side of an image run: the generate fn records the engine's class, steps, step log-probabilities and
latents on the sample with a seed per sample; the image rewards score its last latent; the held-out evaluation
refuses replies from other weights and writes its grid (an engine double in place of the diffusion engine)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from verst.config import load_config
from verst.data import shapes
from verst.inference_client.images import ImageResult
from verst.monitor.image_grid import eval_grid_path
from verst.rewards.image import ShapeClassifier, jpeg_reward, sample_image, shape_alignment
from verst.rewards.values import RewardError
from verst.rollout import RolloutContext
from verst.rollout.images import EVAL_SEED, SEED_KEY, evaluate_images, generate_image
from verst.types import Sample, Status

STEPS = 3


class ImageEngine:
    """Answers generate_images like the diffusion engine: latents drawn from the seed, `n` images."""

    def __init__(self, version: str = "0", abort: bool = False):
        self.version, self.abort, self.calls = version, abort, []

    async def generate_images(self, text, sampling_params, *, rid=None, return_logprob=False):
        self.calls.append((text, dict(sampling_params)))
        seed = sampling_params["sampling_seed"]
        out = []
        for i in range(sampling_params.get("n", 1)):
            latents = np.random.default_rng(seed + i).standard_normal((STEPS + 1, 3, 4, 4)).astype(np.float32)
            out.append(ImageResult(
                rid=f"{rid}-{i}", seed=seed + i, label=shapes.label_of(text), weight_version=self.version,
                finish_reason={"type": "abort", "message": "paused"} if self.abort else {"type": "stop"},
                settings={}, image=latents[-1].clip(-1, 1), latents=latents,
                logprobs=np.full(STEPS, -0.5 - i, dtype=np.float32)))
        return out


def context(tmp_path, engine, *overrides):
    cfg = load_config(None, ["--model.kind", "diffusion", "--cluster.engine", "diffusion", "--cluster.device", "cpu",
                             "--reward.type", "jpeg_compressibility", "--diffusion.num-inference-steps", str(STEPS),
                             "--diffusion.eval-images-per-prompt", "2", *overrides])
    return RolloutContext.from_config(cfg, engine, None, None, generate_fn=generate_image)


def test_an_image_sample_holds_the_engines_class_steps_logprobs_and_latents(tmp_path):
    engine = ImageEngine()
    ctx = context(tmp_path, engine, "--rollout.sampling.seed", "100")
    sample = asyncio.run(generate_image(ctx, Sample(prompt="green square", index=5)))
    assert sample.status is Status.COMPLETED and sample.weight_versions == ["0"]
    assert sample.tokens == [shapes.label_of("green square"), 0, 1, 2] and sample.response_length == STEPS
    assert sample.loss_mask == [1] * STEPS and sample.rollout_logprobs == [-0.5] * STEPS
    assert sample.metadata[SEED_KEY] == 105  # rollout.sampling.seed + the sample's index
    expected = np.random.default_rng(105).standard_normal((STEPS + 1, 3, 4, 4)).astype(np.float32)
    assert torch.equal(sample_image(sample), torch.from_numpy(expected[-1]).clamp(-1, 1))
    text, params = engine.calls[0]
    assert text == "green square" and params["num_inference_steps"] == STEPS and params["sampling_seed"] == 105


def test_without_a_base_seed_each_image_gets_its_own(tmp_path):
    ctx = context(tmp_path, ImageEngine())
    seeds = {asyncio.run(generate_image(ctx, Sample(prompt="red circle", index=0))).metadata[SEED_KEY]
             for _ in range(4)}
    assert len(seeds) == 4


def test_an_aborted_image_is_an_aborted_sample(tmp_path):
    ctx = context(tmp_path, ImageEngine(abort=True))
    sample = asyncio.run(generate_image(ctx, Sample(prompt="red circle")))
    assert sample.status is Status.ABORTED and "paused" in sample.metadata["generate_error"]


def test_the_image_rewards_score_the_last_latent(tmp_path):
    ctx = context(tmp_path, ImageEngine())
    sample = asyncio.run(generate_image(ctx, Sample(prompt="blue triangle", index=1)))
    classifier = ShapeClassifier(shapes.N_CLASSES)
    classifier.save(tmp_path / "clf.pt")
    scored = asyncio.run(shape_alignment(str(tmp_path / "clf.pt"))(sample))
    with torch.no_grad():
        probs = classifier(sample_image(sample)[None].float()).softmax(1)[0]
    label = shapes.label_of("blue triangle")
    assert scored["alignment"] == pytest.approx(float(probs[label]))
    assert scored["correct"] == float(int(probs.argmax()) == label)
    assert asyncio.run(jpeg_reward(sample)) < 0  # minus the kB
    with pytest.raises(RewardError, match="no latents"):
        asyncio.run(jpeg_reward(Sample(tokens=[1], prompt="red circle")))


def test_the_held_out_evaluation_writes_its_grid_and_refuses_other_weights(tmp_path):
    prompts = [Sample(prompt=shapes.describe(k), label=k) for k in (0, 4)]
    ctx = context(tmp_path, ImageEngine(version="3"))
    metrics = asyncio.run(evaluate_images(ctx, prompts, 3, str(tmp_path)))
    assert metrics["eval/n_prompts"] == 2 and metrics["eval/accuracy"] < 0
    from PIL import Image

    assert Image.open(eval_grid_path(tmp_path, 3)).size == (2 * 4 * 4, 2 * 4 * 4)  # a row per prompt
    assert all(params["sampling_seed"] == EVAL_SEED and params["n"] == 2 for _, params in ctx.engine.calls)
    with pytest.raises(ValueError, match="came from weight version 3, not 4"):
        asyncio.run(evaluate_images(ctx, prompts, 4, None))
    with pytest.raises(ValueError, match="set eval.path or data.test_path"):
        asyncio.run(evaluate_images(ctx, [], 3, None))
