"""PPO with a critic on the demo task: the SFT warm start of `make demo`, then recipes/ppo_addition.toml
raises held-out accuracy while the critic's value loss falls (slow: the SFT alone is ~1000 steps)."""

import asyncio
import json
import statistics
from pathlib import Path

import pytest

from examples import demo
from tests.metrics_doc import undocumented
from verst.config import load_config
from verst.monitor import read_metrics
from verst.schedules import SCHEDULES

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--logging.progress", "false", "--logging.tensorboard", "false"]


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_ppo_on_the_demo_task_learns_and_its_critic_fits(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the demo's artifacts and run directories are relative paths
    demo.make_artifacts()
    from verst.schedules.sft import run_sft

    _, sft_run = run_sft(load_config(REPO / demo.SFT_RECIPE, overrides=QUIET))
    cfg = load_config(REPO / "recipes" / "ppo_addition.toml", overrides=["--model.path", str(sft_run / "hf"), *QUIET])
    summary = asyncio.run(SCHEDULES[cfg.schedule](cfg))
    assert summary["train/steps"] == 60
    assert summary["eval/accuracy_after"] > summary["eval/accuracy_before"] + 0.05, summary
    records = read_metrics(Path(cfg.run_dir or Path("runs") / cfg.name))
    losses = [r["train/value_loss"] for r in records if "train/value_loss" in r]
    assert statistics.mean(losses[-10:]) < 0.5 * losses[0], losses  # the first: a zero critic, ½·E[r²]
    assert undocumented(records) == []
    print(json.dumps({k: summary[k] for k in ("eval/accuracy_before", "eval/accuracy_after", "time/total_s")}))
