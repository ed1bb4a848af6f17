"""Evaluation points of an RL run: at most eval.max_in_flight outstanding (wait or skip), each score logged at
the step whose weights it measured (else skipped as pin_violation), and eval.backend on snapshots of the
weights, whose failures are skipped while training goes on."""

from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import pytest

from tests.metrics_doc import undocumented
from tests.run_harness import harness_run, train_step
from tests.unit.test_run_evaluation import scripted_run
from verst.config import load_config
from verst.eval import EvalSkip
from verst.eval.backend import SNAPSHOTS_DIR, call_backend, link_snapshot, retire_snapshots, snapshot_dir
from verst.eval.skip import accept, skip_reason, version_metrics
from verst.inference_client.client import EngineError
from verst.run.rl_run import RLRun

# ---- scores and skips ------------------------------------------------------------------------------


def test_a_score_is_accepted_only_for_the_weights_of_its_step():
    accept({"eval/accuracy": 0.5, "eval/weight_version": 3.0, "eval/mixed_version_ratio": 0.0}, 3)
    accept({"eval/accuracy": 0.5}, 3)  # a backend that reports no versions
    for metrics in ({"eval/weight_version": 2.0}, {"eval/weight_version": 3.0, "eval/mixed_version_ratio": 0.25}):
        with pytest.raises(EvalSkip) as raised:
            accept(metrics, 3)
        assert raised.value.reason == "pin_violation"
    assert version_metrics([["3", "3"], ["3", "4"]]) == {"eval/weight_version": 3.25, "eval/mixed_version_ratio": 0.5}


def test_skip_reasons():
    assert skip_reason(EvalSkip("snapshot_missing")) == "snapshot_missing"
    assert skip_reason(TimeoutError()) == "timeout"
    assert skip_reason(EngineError("http://127.0.0.1:1/generate", None, "ConnectError")) == "unhealthy"
    assert skip_reason(EngineError("http://127.0.0.1:1/generate", 400, "bad")) == "error"
    assert skip_reason(ValueError()) == "error"
    with pytest.raises(ValueError, match="lowercase"):
        EvalSkip("Not A Reason")


def test_a_score_of_other_weights_is_skipped_as_a_pin_violation(tmp_path):
    run = scripted_run(tmp_path, versioned=True)

    async def loop():
        await run.begin()
        await train_step(run)  # version 1, not pushed: the engines still serve 0
        await run.evaluator.start(run.version)
        await run.evaluator.settle()

    asyncio.run(loop())
    rows = run.monitor.logger.rows
    assert rows[1] == (1, {"eval/skipped": 1.0, "eval/skipped_pin_violation": 1.0})
    step, first = rows[0]
    assert step == 0 and first["eval/accuracy"] == 0.5 and first["eval/weight_version"] == 0
    assert first["eval/lag_steps"] == 1 and first["eval/duration_seconds"] >= 0.05
    assert run.evaluator.history == [(0, 0.5)]
    assert undocumented([row for _, row in rows]) == []


def test_overflow_skip_logs_the_point_as_busy(tmp_path):
    run = scripted_run(tmp_path, None, "--eval.overflow", "skip", eval_s=0.3)

    async def loop():
        await run.begin()
        await train_step(run)
        await run.evaluator.start(run.version)  # the step-0 evaluation is still running
        await run.evaluator.settle()

    asyncio.run(loop())
    rows = run.monitor.logger.rows
    assert (1, {"eval/skipped": 1.0, "eval/skipped_busy": 1.0}) in rows
    assert [step for step, m in rows if "eval/accuracy" in m] == [0]


def test_backpressure_waits_for_the_oldest_beyond_max_in_flight(tmp_path):
    run = scripted_run(tmp_path, None, "--eval.max-in-flight", "2", eval_s=0.2)

    async def loop():
        for _ in range(3):
            await run.evaluator.start(run.version)
            assert sum(not task.done() for task in run.evaluator._tasks) <= 2
            await train_step(run)
        await run.evaluator.settle()

    asyncio.run(loop())
    events = run.weights.syncer.events
    starts = [e for e in events if e[0] == "eval start"]
    assert len(starts) == 3 and events.index(("eval end", 0)) < len(events) - 2
    assert sorted(step for step, _ in run.monitor.logger.rows) == [0, 1, 2]


# ---- eval.backend ----------------------------------------------------------------------------------
CALLS: list[tuple[str, int]] = []
RELEASE = threading.Event()


def scoring_backend(snapshot_dir: str, step: int) -> dict:
    CALLS.append((snapshot_dir, step))
    assert (Path(snapshot_dir) / "config.json").exists()
    RELEASE.wait(10)
    if step == 2:
        raise RuntimeError("the harness fell over")
    if step == 3:
        raise EvalSkip("harness_busy", "try later")
    return {"accuracy": 0.1 * step, "eval/n_prompts": 4}


def configured_backend(snapshot_dir: str, step: int, config) -> dict:
    return {"accuracy": float(config.eval.max_prompts)}


def backend_run(tmp_path, *overrides) -> RLRun:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    return harness_run(tmp_path, "--eval.backend", "tests.unit.test_eval_modes:scoring_backend",
                       "--model.path", str(tmp_path / "model"), *overrides)


def test_a_backend_scores_snapshots_while_training_goes_on_and_its_failures_are_skipped(tmp_path):
    CALLS.clear()
    RELEASE.clear()
    run = backend_run(tmp_path, "--eval.max-in-flight", "4", "--eval.keep-snapshots", "1")
    trained = []

    async def loop():
        await run.begin()
        for _ in range(3):
            await run.end_step(await train_step(run), 0.0)  # logs without waiting for the backend
            trained.append(run.version)
        assert trained == [1, 2, 3] and [step for step, _ in run.monitor.logger.rows] == [1, 2, 3]  # no score yet
        RELEASE.set()
        await run.evaluator.finish(run.version)

    asyncio.run(asyncio.wait_for(loop(), 20))
    evals = {step: m for step, m in run.monitor.logger.rows if any(k.startswith("eval/") for k in m)}
    assert sorted(evals) == [0, 1, 2, 3]
    assert evals[0]["eval/accuracy"] == 0 and evals[1]["eval/accuracy"] == pytest.approx(0.1)
    assert evals[1]["eval/n_prompts"] == 4 and evals[1]["eval/snapshot_reused"] == 0
    assert evals[1]["eval/lag_steps"] >= 0 and "eval/export_seconds" in evals[1]
    assert evals[2] == {"eval/skipped": 1.0, "eval/skipped_backend_crashed": 1.0, "eval/export_seconds":
                        evals[2]["eval/export_seconds"], "eval/snapshot_reused": 0.0}
    assert evals[3]["eval/skipped_harness_busy"] == 1.0
    assert sorted(step for _, step in CALLS) == [0, 1, 2, 3]
    assert dict((step, path) for path, step in CALLS)[0] == str(tmp_path / "model")  # step 0: the base model
    assert run.trainer.ranks.exports == [str(tmp_path / "run" / SNAPSHOTS_DIR / f".tmp-step_{s:08d}") for s in (1, 2, 3)]
    assert sorted(p.name for p in (tmp_path / "run" / SNAPSHOTS_DIR).iterdir()) == ["step_00000003"]  # keep 1
    assert run.evaluator.history == [(0, 0.0), (1, pytest.approx(0.1))]
    assert undocumented([m for m in evals.values()]) == []


def test_a_failed_export_is_skipped(tmp_path):
    run = backend_run(tmp_path)

    def broken(*args):
        raise OSError("No space left on device")

    async def loop():
        await train_step(run)
        run.trainer.ranks.apply = broken
        await run.evaluator.start(run.version)
        await run.evaluator.settle()

    asyncio.run(loop())
    assert run.monitor.logger.rows == [(1, {"eval/skipped": 1.0, "eval/skipped_export_failed": 1.0})]


def test_call_backend(tmp_path):
    cfg = load_config(None, ["--eval.max-prompts", "7"])
    assert call_backend(configured_backend, tmp_path, 5, cfg) == {"eval/accuracy": 7.0}
    for reply in (None, {"accuracy": "high"}, [0.5]):
        with pytest.raises(EvalSkip) as raised:
            call_backend(lambda d, s, reply=reply: reply, tmp_path, 5, cfg)
        assert raised.value.reason == "backend_crashed"
    with pytest.raises(EvalSkip) as raised:
        call_backend(configured_backend, tmp_path / "gone", 5, cfg)
    assert raised.value.reason == "snapshot_missing"


def test_snapshots_are_linked_and_retired(tmp_path):
    source = tmp_path / "weights_v00000004"
    source.mkdir()
    (source / "model.safetensors").write_bytes(b"x" * 10)
    target = snapshot_dir(tmp_path / "run", 4)
    target.parent.mkdir(parents=True)
    link_snapshot(source, target)
    assert (target / "model.safetensors").stat().st_ino == (source / "model.safetensors").stat().st_ino
    for step in (1, 2, 3):
        snapshot_dir(tmp_path / "run", step).mkdir()
    removed = retire_snapshots(tmp_path / "run", keep=1, in_use={2})
    assert sorted(p.name for p in removed) == ["step_00000001", "step_00000003"]
    assert json.dumps(sorted(p.name for p in target.parent.iterdir())) == '["step_00000002", "step_00000004"]'


def test_preflight_names_a_backend_that_is_not_there(tmp_path, tiny_model_dir, addition_data_dir):
    from tests.unit.test_cli_checks import good_config
    from verst.cli.preflight import PreflightError, preflight

    preflight(good_config(tmp_path, tiny_model_dir, addition_data_dir, "--eval.backend",
                          "examples.eval_backend.engine:score"), rl=True)
    cfg = good_config(tmp_path, tiny_model_dir, addition_data_dir, "--eval.backend", "nowhere.scoring:score")
    with pytest.raises(PreflightError, match=r"eval.backend = 'nowhere.scoring:score': cannot import"):
        preflight(cfg, rl=True)


def test_verst_eval_names_the_weights_it_did_not_find(tmp_path, capsys):
    from verst.cli.eval import main

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text("name: gone\n")
    assert main([str(run_dir), "--step", "3"]) == 2
    err = capsys.readouterr().err
    assert "has no weights of step 3" in err and "step_00000003" in err and "checkpoints there: none" in err
    assert main([str(tmp_path)]) == 2 and "no config.yaml" in capsys.readouterr().err


def test_the_last_point_waits_for_a_free_slot_under_overflow_skip(tmp_path):
    run = scripted_run(tmp_path, None, "--eval.overflow", "skip", eval_s=0.2)

    async def loop():
        await run.begin()
        await train_step(run)
        run.weights.syncer.version = run.version  # pushed without waiting for the evaluation (as eval.backend's are)
        await run.evaluator.finish(run.version)  # the step-0 evaluation is still running

    asyncio.run(loop())
    assert [(step, "eval/accuracy" in m) for step, m in run.monitor.logger.rows] == [(0, True), (1, True)]
