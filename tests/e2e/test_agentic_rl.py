"""Agentic RL end to end on Ray: the calculator agent (official openai client) runs each episode against
the session server, whose engine calls go through sglang-router (kept here for one engine) to the embedded engine; GRPO trains on
the assembled trajectories; held-out success is measured by greedy agent episodes.

The fast test runs two sync steps from the untrained tiny model. The slow one is the whole demo: the
SFT warm start on the teacher's conversations, then GRPO, which must raise held-out success."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from examples.calculator.make_data import make_data
from verst.config import load_config
from verst.monitor import read_metrics
from verst.schedules import SCHEDULES

REPO = Path(__file__).resolve().parents[2]
QUIET = ["--logging.tensorboard", "false", "--logging.progress", "false"]


@pytest.fixture(scope="module")
def ray_session():
    from verst.orchestration import RaySession

    with RaySession(slots=4, log_to_driver=False):
        yield


@pytest.fixture(scope="module")
def calculator_data(tmp_path_factory):
    return make_data(tmp_path_factory.mktemp("data") / "calculator", n_train=400, n_test=40)


def test_agentic_sync_steps_with_session_server(ray_session, tiny_model_dir, calculator_data,
                                                tmp_path):
    cfg = load_config(REPO / "recipes" / "grpo_calculator.toml", [
        "--run-dir", str(tmp_path / "run"), "--model.path", str(tiny_model_dir), "--schedule", "sync",
        "--data.train-path", str(calculator_data["train"]), "--data.test-path", str(calculator_data["test"]),
        "--rollout.batch-size", "2", "--rollout.n-samples-per-prompt", "4", "--rollout.num-rollouts", "2",
        "--rollout.max-response-tokens", "12", "--rollout.dynamic-filter", "null",
        "--eval.max-prompts", "6", "--eval.interval", "0", "--cluster.router", "always", *QUIET,
    ])
    summary = asyncio.run(SCHEDULES[cfg.schedule](cfg))
    assert summary["train/steps"] == 2 and (summary["eval/version_before"], summary["eval/version_after"]) == (0, 2)
    records = read_metrics(Path(cfg.run_dir))
    train = [r for r in records if "train/loss" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        assert r["sync/version"] == r["step"] and "rollout/reward_mean" in r
        # trajectories came from the session server, which checked them against a re-render
        assert any(k.startswith("rollout/tito_mismatch_rate") for k in r), sorted(r)
    evals = [r for r in records if "eval/success" in r]
    assert [r["eval/weight_version"] for r in evals] == [0, 2]
    assert all(r["eval/n_prompts"] == 6 and r["eval/aborted"] == 0 for r in evals)


@pytest.mark.slow
@pytest.mark.timeout(3600)  # ~15 min of SFT and ~15 min of GRPO on 2 cores
def test_calculator_demo_raises_success(ray_session, tiny_model_dir, tmp_path):
    """SFT warm start on the teacher's conversations, then GRPO: held-out greedy success goes up."""
    from verst.schedules.sft import run_sft

    data = make_data(tmp_path / "data")
    paths = ["--data.train-path", str(data["sft_teacher"]), "--data.test-path", str(data["test"])]
    sft_cfg = load_config(REPO / "recipes" / "sft_calculator.toml", [
        "--run-dir", str(tmp_path / "sft"), "--model.path", str(tiny_model_dir), *paths, *QUIET])
    sft_summary, sft_dir = run_sft(sft_cfg)
    assert sft_summary["eval/success_after"] >= 0.2
    cfg = load_config(REPO / "recipes" / "grpo_calculator.toml", [
        "--run-dir", str(tmp_path / "rl"), "--model.path", str(sft_dir / "hf"),
        "--data.train-path", str(data["train"]), "--data.test-path", str(data["test"]), *QUIET])
    summary = asyncio.run(SCHEDULES[cfg.schedule](cfg))
    print(json.dumps({"sft": sft_summary, "rl": summary}))
    assert summary["eval/success_before"] == pytest.approx(sft_summary["eval/success_after"], abs=0.02)
    assert summary["eval/success_after"] >= summary["eval/success_before"] + 0.15
