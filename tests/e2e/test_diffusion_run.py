"""A diffusion RL run through the same loop as text (docs/diffusion.md): diffusion engines behind sglang-router,
the rollout manager's image generate fn and classifier reward, the denoiser under the FSDP2 backend on a trainer
rank actor, weight sync to the engines, held-out image grids, checkpoints and resume; on a tiny denoiser."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.e2e.test_rl_schedules import ray_session  # noqa: F401  (a module-scoped Ray session)
from tests.metrics_doc import undocumented
from verst.config import ConfigError, load_config
from verst.data import shapes
from verst.models import diffusion
from verst.monitor import read_metrics
from verst.rewards.image import ShapeClassifier
from verst.schedules import SCHEDULES

STEPS = 3  # denoising steps of the tiny run


@pytest.fixture(scope="module")
def shapes_run(tmp_path_factory):
    """A seeded tiny denoiser, a quickly fitted classifier and the prompt files."""
    root = tmp_path_factory.mktemp("shapes")
    diffusion.save(diffusion.init_denoiser(shapes.N_CLASSES, widths=(8, 16), seed=0), root / "denoiser")
    images, labels = (torch.tensor(a) for a in shapes.dataset(270, seed=1))
    classifier = ShapeClassifier(shapes.N_CLASSES)
    classifier.fit(images, labels, steps=30)
    classifier.save(root / "classifier.pt")
    shapes.write_prompts(root / "prompts", repeat=2)
    return root


def diffusion_config(tmp_path, root, *overrides):
    return load_config(None, [
        "--name", "e2e-diffusion", "--run-dir", str(tmp_path / "run"), "--model.path", str(root / "denoiser"),
        "--model.kind", "diffusion", "--cluster.engine", "diffusion", "--cluster.device", "cpu",
        "--data.train-path", str(root / "prompts" / "train.jsonl"),
        "--data.test-path", str(root / "prompts" / "test.jsonl"),
        "--reward.type", "shape_alignment", "--reward.model-path", str(root / "classifier.pt"),
        "--reward.key", "alignment", "--algorithm.policy-loss", "flow_grpo", "--algorithm.eps-clip", "1e-3",
        "--diffusion.num-inference-steps", str(STEPS), "--diffusion.eval-images-per-prompt", "2",
        "--rollout.batch-size", "3", "--rollout.n-samples-per-prompt", "4", "--rollout.num-rollouts", "2",
        "--rollout.sampling.seed", "7", "--trainer.lr", "1e-3", "--eval.interval", "1", "--eval.max-prompts", "3",
        "--logging.tensorboard", "false", "--logging.progress", "false", *overrides,
    ])


def run(cfg):
    return asyncio.run(SCHEDULES[cfg.schedule](cfg))


def trained_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return diffusion.load(run_dir / "hf").state_dict()


@pytest.mark.parametrize("schedule,transport,engines,extra", [
    ("sync", "tensor", "1", ()), ("sync", "disk", "1", ()),
    # a KL term to the base: the trainer rank holds a frozen reference denoiser
    ("fully_async", "distributed", "2", ("--algorithm.kl-loss-coef", "0.01", "--algorithm.old-logprobs", "rollout")),
])
def test_a_denoiser_trains_through_the_run_and_its_weights_reach_the_engines(
        ray_session, shapes_run, tmp_path, schedule, transport, engines, extra):  # noqa: F811
    cfg = diffusion_config(tmp_path, shapes_run, "--schedule", schedule, "--sync.transport", transport,
                           "--cluster.num-engines", engines, "--checkpoint.interval", "1", *extra)
    summary = run(cfg)
    run_dir = Path(cfg.run_dir)
    assert summary["train/steps"] == 2
    assert summary["eval/version_before"] == 0 and summary["eval/version_after"] == 2
    train = [r for r in read_metrics(run_dir) if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["sync/version"] == r["step"]  # every step's weights reached the engines
        assert ("train/kl" in r) == bool(extra)
        assert r["train/grad_norm"] > 0 and np.isfinite(r["train/loss"])
        assert 0 < r["rollout/reward_mean"] <= 1  # the classifier's probability of the prompt's class
    # the trainer's recomputed step log-probabilities are the engines' where they sampled with the trainer's weights
    fresh = [r for r in train if r["train/token_staleness_mean"] == 0]
    assert fresh and all(r["train/rollout_logprob_abs_diff"] < 1e-5 for r in fresh)
    assert undocumented(read_metrics(run_dir)) == []  # every key it logs is in docs/metrics.md
    evals = [r for r in read_metrics(run_dir) if "eval/accuracy" in r]
    assert [r["step"] for r in evals] == [0, 1, 2]
    for r in evals:  # 3 held-out prompts x 2 images, scored by the classifier
        assert 0 < r["eval/accuracy"] <= 1 and 0 <= r["eval/reward/correct"] <= 1 and r["eval/n_prompts"] == 3
        grid = run_dir / "eval_images" / f"step_{r['step']:05d}.png"
        from PIL import Image

        assert Image.open(grid).size == (2 * 16 * 4, 3 * 16 * 4)  # a row per prompt, 2 images each, 4x
    # the engines served the trained weights: the exported denoiser differs from the base and is what they drew
    base = diffusion.load(shapes_run / "denoiser").state_dict()
    trained = trained_weights(run_dir)
    assert set(trained) == set(base)
    assert any(not torch.equal(trained[k], base[k]) for k in base)
    report = (run_dir / "report.html").read_text()
    assert "eval_images/step_00002.png" in report or "data:image/png;base64" in report


@pytest.mark.slow  # three runs, about 30 s; the backend's exact resume is test_diffusion_backend's, in `make test`
def test_a_diffusion_run_resumes_from_its_checkpoint(ray_session, shapes_run, tmp_path):  # noqa: F811
    """Two steps straight, or one step, a stop and a resume from its checkpoint: the same weights, up to the float32
    noise of images sampled in other batches (the engine batches the requests that arrive together), which AdamW
    turns into moves of up to lr on weights whose gradient is that noise: far closer than one step apart."""
    common = ("--schedule", "sync", "--sync.transport", "tensor", "--eval.interval", "0")
    straight = diffusion_config(tmp_path / "a", shapes_run, *common)
    run(straight)
    first = diffusion_config(tmp_path / "b", shapes_run, *common, "--rollout.num-rollouts", "1")
    run(first)
    one_step = trained_weights(Path(first.run_dir))
    resumed = first.model_copy(update={
        "rollout": first.rollout.model_copy(update={"num_rollouts": 2}),
        "checkpoint": first.checkpoint.model_copy(update={"load": first.run_dir}),
    })
    summary = run(resumed)
    assert summary["train/steps"] == 2
    assert [(s["from_step"], s["to_step"]) for s in summary["segments"]] == [(0, 1), (1, 2)]  # one step each
    a, b = trained_weights(Path(straight.run_dir)), trained_weights(Path(resumed.run_dir))

    def apart(x, y) -> float:
        return float(sum((x[k] - y[k]).abs().sum() for k in x) / sum(x[k].numel() for k in x))

    assert apart(a, one_step) > 1e-4  # the second step moved the weights
    assert apart(a, b) < 0.05 * apart(a, one_step)  # the resumed run took that step from the saved state


@pytest.mark.parametrize("override,field", [
    (("--cluster.engine", "embedded"), "cluster.engine"),
    (("--lora.enabled", "true"), "lora.enabled"),
    (("--reward.type", "numeric_match"), "reward.type"),
    (("--algorithm.advantage-estimator", "ppo"), "algorithm.advantage_estimator"),
    (("--algorithm.entropy-coef", "0.01"), "algorithm.entropy_coef"),
    (("--rollout.partial-rollout", "true"), "rollout.partial_rollout"),
    (("--schedule", "fully_async"), "algorithm.old_logprobs"),
])
def test_what_a_diffusion_run_cannot_use_is_refused_by_name(shapes_run, tmp_path, override, field):
    with pytest.raises((ConfigError, ValueError), match=field.replace(".", r"\.")):
        diffusion_config(tmp_path, shapes_run, *override)


def test_the_prompt_files_hold_every_class(shapes_run):
    rows = [json.loads(line) for line in (shapes_run / "prompts" / "test.jsonl").read_text().splitlines()]
    assert [shapes.label_of(r["prompt"]) for r in rows] == list(range(shapes.N_CLASSES))
