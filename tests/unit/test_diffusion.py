"""The diffusion leaves: the shapes dataset, the Flow-GRPO SDE sampler's recorded log-probabilities and their
recomputation on the trainer's side, the registered Flow-GRPO loss, and the diffusers round trip."""

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")

from verst.algo.advantages import group_relative_rewards  # noqa: E402
from verst.algo.flow_grpo import flow_grpo_loss  # noqa: E402
from verst.config.registries import POLICY_LOSSES  # noqa: E402
from verst.data import shapes  # noqa: E402
from verst.models import diffusion  # noqa: E402


def test_shapes_are_drawn_by_seed_and_described():
    a, la = shapes.dataset(18, seed=1)
    b, lb = shapes.dataset(18, seed=1)
    assert np.array_equal(a, b) and np.array_equal(la, lb)
    assert a.shape == (18, 3, 16, 16) and a.min() >= -1 and a.max() <= 1
    assert sorted(np.bincount(la).tolist()) == [2] * shapes.N_CLASSES
    assert shapes.describe(0) == "red circle"
    assert all(shapes.label_of(shapes.describe(k)) == k for k in range(shapes.N_CLASSES))
    with pytest.raises(ValueError, match="purple circle"):
        shapes.label_of("purple circle")


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_trainer_recomputes_the_samplers_step_logprobs_within_1e_5(guidance):
    model = diffusion.init_denoiser(shapes.N_CLASSES, widths=(8, 16), seed=0)
    labels = torch.tensor([0, 4, 8])
    traj = diffusion.sample(model, labels, seed=7, steps=6, guidance=guidance)
    assert traj.latents.shape == (3, 7, 3, 16, 16) and traj.logprobs.shape == (3, 6)
    again = diffusion.sample(model, labels, seed=7, steps=6, guidance=guidance)
    assert torch.equal(traj.latents, again.latents)
    recomputed = diffusion.step_logprobs(model, traj.latents, labels, guidance=guidance)
    assert recomputed.requires_grad
    assert (recomputed - traj.logprobs).abs().max().item() <= 1e-5
    # another policy gives other step log-probabilities: the check can fail
    with torch.no_grad():
        next(model.parameters()).add_(0.5)
    moved = diffusion.step_logprobs(model, traj.latents, labels, guidance=guidance)
    assert (moved - traj.logprobs).abs().max().item() > 1e-3


def test_flow_grpo_loss_raises_the_better_images_step_logprobs():
    torch.manual_seed(0)
    model = diffusion.init_denoiser(shapes.N_CLASSES, widths=(8, 16), seed=0)
    labels = torch.tensor([1, 1, 1, 1])
    traj = diffusion.sample(model, labels, seed=3, steps=4)
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    adv = group_relative_rewards(rewards, torch.zeros(4, dtype=torch.long), std_normalize=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    lp = diffusion.step_logprobs(model, traj.latents, labels)
    loss, metrics = flow_grpo_loss(lp, traj.logprobs, adv, ref_logprobs=traj.logprobs, eps_clip=0.2, kl_coef=0.01)
    assert set(metrics) == {"train/pg_loss", "train/pg_clipfrac", "train/kl", "train/loss"}
    opt.zero_grad()
    loss.backward()
    opt.step()
    after = diffusion.step_logprobs(model, traj.latents, labels).detach()
    gain = (after - traj.logprobs).sum(1)
    assert gain[[0, 3]].mean() > gain[[1, 2]].mean()


def test_flow_grpo_loss_refuses_bad_shapes_and_a_kl_without_reference():
    lp = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="one per image"):
        flow_grpo_loss(lp, lp, torch.zeros(3))
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        flow_grpo_loss(lp, lp, torch.zeros(2), kl_coef=0.1)
    assert POLICY_LOSSES.load("flow_grpo").__name__ == "flow_grpo_token_loss"


def test_the_denoiser_round_trips_through_diffusers_format(tmp_path):
    model = diffusion.init_denoiser(shapes.N_CLASSES, widths=(8, 16), seed=0)
    diffusion.save(model, tmp_path / "base")
    assert (tmp_path / "base" / "config.json").exists()
    loaded = diffusion.load(tmp_path / "base")
    labels = torch.tensor([2, 5])
    assert torch.equal(diffusion.sample(model, labels, seed=1, steps=3).latents,
                       diffusion.sample(loaded, labels, seed=1, steps=3).latents)


def test_the_diffusion_commands_write_their_outputs(tmp_path, capsys):
    import json

    from verst.cli import diffusion as cli

    assert cli.main(["init", "--out", str(tmp_path / "base"), "--widths", "8,16"]) == 0
    assert diffusion.load(tmp_path / "base").config.num_class_embeds == shapes.N_CLASSES + 1
    assert cli.main(["classifier", "--out", str(tmp_path / "clf.pt"), "--steps", "20"]) == 0
    assert "classifier held-out accuracy" in capsys.readouterr().out
    assert cli.main(["prompts", "--out", str(tmp_path / "prompts"), "--repeat", "2"]) == 0
    train = [json.loads(line) for line in (tmp_path / "prompts" / "train.jsonl").read_text().splitlines()]
    assert [r["label"] for r in train] == list(range(shapes.N_CLASSES)) * 2  # the classes in turn
    assert all(shapes.label_of(r["prompt"]) == r["label"] for r in train)
