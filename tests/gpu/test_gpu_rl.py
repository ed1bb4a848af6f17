"""`make demo`'s task on one CUDA GPU: the SFT warm start, then 20 GRPO steps of the sync schedule with the
trainer and the engine colocated on the GPU (CUDA-IPC weight sync, the engine's memory released around every
train step). Held-out greedy accuracy before and after RL is printed, and written to $VERST_GPU_OUT/rl.json
when that is set (scripts/gpu/check.sh collects it)."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
STEPS = 20
REPO = Path(__file__).resolve().parents[2]


def test_grpo_on_the_demo_task_colocated_on_one_gpu(tmp_path, monkeypatch):
    from verst.config import load_config
    from verst.schedules import SCHEDULES, demo
    from verst.schedules.sft import run_sft

    monkeypatch.chdir(tmp_path)  # the demo's artifacts and runs go here
    # the Ray actors import this checkout whatever the working directory
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    recipes = REPO / "recipes"
    demo.make_artifacts()
    sft_summary, sft_dir = run_sft(load_config(recipes / "sft_addition.toml",
                                               overrides=["--cluster.device", "cuda", "--overwrite"]))
    cfg = load_config(recipes / "grpo_addition.toml", overrides=[
        "--model.path", str(Path(sft_dir) / "hf"), "--schedule", "sync", "--cluster.device", "cuda",
        "--cluster.placement", "colocated", "--sync.transport", "tensor", "--rollout.num-rollouts", str(STEPS),
        "--overwrite"])
    summary = asyncio.run(SCHEDULES["sync"](cfg))
    before, after = demo.check_rl_summary(summary)
    result = {"sft_accuracy_before": sft_summary["eval/accuracy_before"], "rl_accuracy_before": before,
              "rl_accuracy_after": after, "steps": summary["train/steps"], "seconds": summary.get("time/total_s")}
    print(f"GRPO on CUDA, sync colocated, {summary['train/steps']} steps: accuracy {before:.1%} -> {after:.1%}")
    if os.environ.get("VERST_GPU_OUT"):
        Path(os.environ["VERST_GPU_OUT"], "rl.json").write_text(json.dumps(result, indent=1))
    assert summary["train/steps"] == STEPS
    assert after >= before - 0.05  # RL from the warm start does not undo it (accuracy itself is reported)
