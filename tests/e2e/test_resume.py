"""Checkpoints and resume of RL runs on Ray with the tiny model: a run stopped after step k and resumed
reaches step n with the same metrics and parameters as one that ran through; the final model loads."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

from tests.e2e.test_rl_schedules import rl_config, run_schedule
from tests.e2e.test_rl_schedules import ray_session  # noqa: F401  (the module's Ray session)
from verst.monitor import read_metrics
from verst.monitor.checkpoints import CheckpointError, read_latest, read_manifest

SEEDED = ("--rollout.sampling.seed", "7", "--schedule", "sync", "--sync.transport", "disk")
COMPARED = ("train/loss", "train/grad_norm", "rollout/reward_mean", "train/advantage_abs_mean")


def train_rows(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in read_metrics(run_dir) if "train/loss" in r}


def assert_same_run(resumed: Path, through: Path, steps: int) -> None:
    a, b = train_rows(resumed), train_rows(through)
    assert sorted(a) == sorted(b) == list(range(1, steps + 1))
    for step in a:
        for key in COMPARED:
            assert a[step][key] == pytest.approx(b[step][key], abs=1e-6), (step, key)
    pa, pb = load_file(str(resumed / "hf" / "model.safetensors")), load_file(str(through / "hf" / "model.safetensors"))
    assert pa.keys() == pb.keys()
    for name in pa:
        np.testing.assert_allclose(pa[name], pb[name], atol=1e-6, rtol=0, err_msg=name)


def test_sync_resume_matches_an_uninterrupted_run(ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    through = rl_config(tmp_path / "through", tiny_model_dir, addition_data_dir, *SEEDED,
                        "--rollout.num-rollouts", "3", "--checkpoint.interval", "1", "--checkpoint.keep-last", "2")
    run_schedule(through)
    ckpts = Path(through.run_dir) / "checkpoints"
    assert sorted(p.name for p in ckpts.glob("step_*")) == ["step_2", "step_3"]  # keep_last
    assert read_latest(Path(through.run_dir)).name == "step_3"
    manifest = read_manifest(ckpts / "step_3")
    assert manifest["version"] == 3 and manifest["config"]["rollout"]["num_rollouts"] == 3
    assert [r["step"] for r in read_metrics(Path(through.run_dir)) if "time/checkpoint_s" in r] == [1, 2, 3]
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(Path(through.run_dir) / "hf")  # the final model loads

    first = rl_config(tmp_path / "resumed", tiny_model_dir, addition_data_dir, *SEEDED, "--rollout.num-rollouts", "1")
    run_schedule(first)
    resumed = first.model_copy(update={
        "rollout": first.rollout.model_copy(update={"num_rollouts": 3}),
        "checkpoint": first.checkpoint.model_copy(update={"load": first.run_dir}),
    })
    summary = run_schedule(resumed)
    assert summary["train/steps"] == 3
    assert_same_run(Path(resumed.run_dir), Path(through.run_dir), steps=3)


def test_resume_refuses_a_changed_field(ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    from verst.schedules.checkpointing import prepare_resume

    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *SEEDED, "--rollout.num-rollouts", "1",
                    "--checkpoint.export-hf", "false")
    run_schedule(cfg)
    changed = rl_config(tmp_path, tiny_model_dir, addition_data_dir, *SEEDED, "--rollout.num-rollouts", "2",
                        "--trainer.lr", "3e-4", "--checkpoint.load", cfg.run_dir, "--eval.max-prompts", "4")
    with pytest.raises(CheckpointError, match=r"trainer.lr: checkpoint 0.0001, now 0.0003"):
        prepare_resume(changed)
    manifest = json.loads((Path(cfg.run_dir) / "checkpoints" / "step_1" / "manifest.json").read_text())
    assert manifest["eval_history"][0][0] == 0
