"""Evaluation modes in short RL runs on the tiny model: the rollout engines under the fully async schedule
(the generation an evaluation displaced), an external backend scoring snapshots of the weights in an
engine process of its own, whose crash is skipped while training goes on, and an evaluation fleet of
engines behind a router of their own, loaded with each snapshot."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_rl_schedules import REPO, ray_session, rl_config, run_schedule  # noqa: F401 - the fixture
from tests.metrics_doc import undocumented
from verst.eval.backend import SNAPSHOTS_DIR
from verst.monitor import read_metrics


def eval_records(records):
    return {r["step"]: r for r in records if any(k.startswith("eval/") for k in r)}


def test_shared_engines_under_fully_async_record_the_displaced_engine_time(
        ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "fully_async",
                    "--sync.transport", "disk", "--eval.interval", "1")
    summary = run_schedule(cfg)
    records = read_metrics(Path(cfg.run_dir))
    evals = eval_records(records)
    assert sorted(evals) == [0, 1, 2] and summary["eval/version_after"] == 2
    for step, r in evals.items():
        assert r["eval/weight_version"] == step and r["eval/mixed_version_ratio"] == 0
        assert r["eval/displaced_engine_seconds"] == r["eval/duration_seconds"] * cfg.cluster.num_engines > 0
        assert r["eval/lag_steps"] >= 0
    assert undocumented(records) == []


def test_a_backend_scores_snapshots_in_its_own_engine_and_a_crash_is_skipped(
        ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "one_step_off",
                    "--sync.transport", "disk", "--eval.interval", "1", "--eval.max-in-flight", "2",
                    "--eval.keep-snapshots", "1", "--eval.backend", "tests.e2e.eval_backends:crashing_at_step_1")
    summary = run_schedule(cfg)
    records = read_metrics(Path(cfg.run_dir))
    evals = eval_records(records)
    assert sorted(evals) == [0, 1, 2] and summary["train/steps"] == 2  # training went on past the crash
    assert evals[1]["eval/skipped_backend_crashed"] == 1 and "eval/accuracy" not in evals[1]
    for step in (0, 2):  # scored by the example's own engine, serving the snapshot as version `step`
        assert evals[step]["eval/weight_version"] == step and evals[step]["eval/n_prompts"] == 8
        assert 0 <= evals[step]["eval/accuracy"] <= 1 and evals[step]["eval/duration_seconds"] > 0
    assert evals[2]["eval/snapshot_reused"] == 1  # the disk transport's snapshot of step 2, linked
    assert summary["eval/version_before"] == 0 and summary["eval/version_after"] == 2
    snapshots = Path(cfg.run_dir) / SNAPSHOTS_DIR
    assert [p.name for p in snapshots.iterdir()] == ["step_00000002"]  # eval.keep_snapshots = 1
    assert undocumented(records) == []


def test_an_evaluation_fleet_scores_each_snapshot_at_its_step_while_training_goes_on(
        ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "one_step_off",
                    "--sync.transport", "disk", "--eval.interval", "1", "--eval.num-engines", "2",
                    "--eval.max-in-flight", "2", "--eval.keep-snapshots", "1")
    summary = run_schedule(cfg)
    run_dir = Path(cfg.run_dir)
    records = read_metrics(run_dir)
    evals = eval_records(records)
    assert sorted(evals) == [0, 1, 2] and summary["train/steps"] == 2
    for step, r in evals.items():  # each snapshot loaded onto both engines as version `step`, then scored
        assert r["eval/weight_version"] == step and r["eval/mixed_version_ratio"] == 0 and r["eval/n_prompts"] == 8
        assert 0 <= r["eval/accuracy"] <= 1 and r["eval/fleet_load_seconds"] > 0 and r["eval/fleet_restarts"] == 0
        assert r["eval/lag_steps"] >= 0 and r["eval/duration_seconds"] > 0 and "eval/skipped" not in r
        assert "eval/displaced_engine_seconds" not in r  # the rollout engines did not serve it
    assert evals[2]["eval/snapshot_reused"] == 1  # the disk transport's snapshot of step 2, linked
    assert summary["eval/version_before"] == 0 and summary["eval/version_after"] == 2
    assert [p.name for p in (run_dir / SNAPSHOTS_DIR).iterdir()] == ["step_00000002"]  # eval.keep_snapshots = 1
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {"eval-0.log", "eval-1.log", "eval-router.log"} <= logs  # two engines of its own, its own router
    assert undocumented(records) == []


def test_verst_eval_scores_saved_weights_later_under_their_step(
        ray_session, tiny_model_dir, addition_data_dir, tmp_path):  # noqa: F811
    """A checkpoint (exported first) and the final export, scored from the command line after the run."""
    cfg = rl_config(tmp_path, tiny_model_dir, addition_data_dir, "--schedule", "sync", "--checkpoint.interval", "1")
    run_schedule(cfg)
    run_dir = Path(cfg.run_dir)
    in_run = eval_records(read_metrics(run_dir))
    for args in (["--step", "1"], []):
        subprocess.run([sys.executable, "-m", "verst.cli.main", "eval", str(run_dir), *args], check=True,
                       cwd=REPO, timeout=300)
    records = read_metrics(run_dir)
    first, final = records[-2:]
    assert (first["step"], final["step"]) == (1, 2) and first["eval/offline"] == final["eval/offline"] == 1
    assert first["eval/weight_version"] == 1 and final["eval/weight_version"] == 2
    assert (run_dir / SNAPSHOTS_DIR / "step_00000001" / "config.json").is_file()  # the checkpoint's export
    assert final["eval/accuracy"] == in_run[2]["eval/accuracy"]  # the same weights the engines scored
    assert first["eval/n_prompts"] == 8 and undocumented(records) == []


def test_the_harness_backend_scores_a_snapshot_with_lm_eval(tiny_model_dir, addition_data_dir, tmp_path):
    """examples/eval_backend/harness.py: lm-evaluation-harness on a task written from the held-out prompts."""
    pytest.importorskip("lm_eval", reason="the lm-eval extra: pip install 'verst[lm-eval]'")
    from examples.eval_backend.harness import score
    from verst.config import load_config
    from verst.eval.backend import call_backend

    cfg = load_config(None, ["--model.path", str(tiny_model_dir), "--data.test-path",
                             str(addition_data_dir / "test.jsonl"), "--data.apply-chat-template", "false",
                             "--rollout.max-response-tokens", "4", "--eval.max-prompts", "8",
                             "--cluster.device", "cpu"])
    metrics = call_backend(score, Path(tiny_model_dir), 0, cfg)
    assert set(metrics) == {"eval/harness_exact_match", "eval/n_prompts"} and metrics["eval/n_prompts"] == 8
    assert 0 <= metrics["eval/harness_exact_match"] <= 1
    assert undocumented([metrics]) == []
