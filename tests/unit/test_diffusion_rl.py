"""Flow-GRPO steps on a tiny denoiser raise a reward on held-out seeds; the `verst diffusion` commands run end
to end (init, classifier, rl) and write their outputs."""

import json

import pytest
import torch
from PIL import Image

pytest.importorskip("diffusers")

from verst.cli import diffusion as cli  # noqa: E402
from verst.data import shapes  # noqa: E402
from verst.models import diffusion  # noqa: E402
from verst.trainer.diffusion import FlowGRPOSettings, flow_grpo_step  # noqa: E402


def brightness(images, labels):
    return images.mean(dim=(1, 2, 3))


def test_flow_grpo_steps_raise_a_reward_on_held_out_seeds():
    model = diffusion.init_denoiser(shapes.N_CLASSES, widths=(8, 16), seed=0)
    labels = torch.arange(4)
    held = lambda: brightness(diffusion.sample(model, labels.repeat(4), seed=999, steps=4).images, None).mean()  # noqa: E731
    before = held().item()
    settings = FlowGRPOSettings(group_size=6, steps=4, lr=3e-3, micro_batch=24)
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    for step in range(6):
        metrics = flow_grpo_step(model, optimizer, labels, brightness, settings, seed=step)
    assert {"rollout/reward_mean", "train/pg_loss", "train/pg_clipfrac"} <= set(metrics)
    assert held().item() > before + 0.05


def test_the_diffusion_commands_run_end_to_end(tmp_path, capsys):
    assert cli.main(["init", "--out", str(tmp_path / "base"), "--widths", "8,16"]) == 0
    assert cli.main(["classifier", "--out", str(tmp_path / "clf.pt"), "--steps", "20"]) == 0
    assert cli.main(["rl", "--base", str(tmp_path / "base"), "--classifier", str(tmp_path / "clf.pt"),
                     "--out", str(tmp_path / "run"), "--rl-steps", "2", "--prompts-per-step", "2",
                     "--group-size", "3", "--sample-steps", "3", "--eval-images", "1", "--kl-coef", "0.01"]) == 0
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [1, 2]
    assert "train/kl" in json.loads(lines[-1])
    result = json.loads((tmp_path / "run" / "result.json").read_text())
    assert set(result) == {"before", "after"}
    assert (tmp_path / "run" / "denoiser" / "config.json").exists()
    for grid in ("samples_before.png", "samples_after.png"):  # one row of the 9 classes, each 16 px enlarged 4 times
        assert Image.open(tmp_path / "run" / grid).size == (9 * 64, 64)
    out = capsys.readouterr().out
    assert "before: held-out mean reward" in out and "after: held-out mean reward" in out
    assert str(tmp_path / "run" / "samples_after.png") in out
