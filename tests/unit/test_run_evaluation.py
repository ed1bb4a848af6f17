"""Held-out evaluations in the background of an RL run: each scores the version the engines serve when it
starts, the weights do not change under it, and its row is logged at its own step, in step order."""

from __future__ import annotations

import asyncio
import io

import pytest

from tests.run_harness import harness_run, script_evaluation, train_step
from verst.monitor.progress import RunProgress
from verst.run.rl_run import RLRun


def scripted_run(tmp_path, out=None, *overrides, **script) -> RLRun:
    """A stand-in run whose evaluation takes 0.05 s and records when it starts and ends (`script_evaluation`)."""
    run = harness_run(tmp_path, *overrides)
    run.monitor.progress = RunProgress("sync", 3, mode="lines" if out else "off", stream=out)
    script_evaluation(run, **script)
    return run


def test_an_evaluation_overlaps_the_next_step_and_the_push_waits_for_it(tmp_path):
    out = io.StringIO()
    run = scripted_run(tmp_path, out)

    async def loop():
        run.startup_metrics = {"time/startup_s": 1.5}
        await run.begin()
        for _ in range(3):
            metrics = await train_step(run)  # trains while the previous version is evaluated
            await run.end_step(metrics, 0.0)  # push (after the evaluation), log, evaluate
        await run.evaluator.finish(run.version)

    asyncio.run(loop())
    events, rows = run.weights.syncer.events, run.monitor.logger.rows
    # the weights never change under an evaluation: every push comes after the evaluation before it ended
    assert events == [("eval start", 0), ("eval end", 0), ("push", 1), ("eval start", 1), ("eval end", 1),
                      ("push", 2), ("eval start", 2), ("eval end", 2), ("push", 3), ("eval start", 3),
                      ("eval end", 3)]
    steps = [(step, "eval/accuracy" in m) for step, m in rows]
    assert steps == [(0, True), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
    assert rows[0][1]["time/startup_s"] == 1.5  # start-up goes with the step-0 evaluation
    assert [m["eval/weight_version"] for _, m in rows if "eval/accuracy" in m] == [0, 1, 2, 3]
    assert run.evaluator.history == [(0, 0.0), (1, 0.1), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    assert "[sync] step 2 evaluated: eval 20.0%" in out.getvalue().splitlines()
    assert run.monitor.progress.last_eval == {"eval/accuracy": pytest.approx(0.3)}


def test_the_last_version_is_evaluated_once(tmp_path):
    run = scripted_run(tmp_path)

    async def loop():
        await train_step(run)
        await run.evaluator.start(run.version)
        await run.evaluator.finish(run.version)  # already being measured: waits for it, no second evaluation
        await train_step(run)
        await run.evaluator.finish(run.version)

    asyncio.run(loop())
    assert [step for step, m in run.monitor.logger.rows] == [1, 2]
    assert [e for e in run.weights.syncer.events if e[0] == "eval start"] == [("eval start", 0), ("eval start", 0)]


def test_a_failed_evaluation_stops_the_run_at_the_next_push_under_on_error_stop(tmp_path):
    run = scripted_run(tmp_path, None, "--eval.on-error", "stop", fail_at=0)

    async def loop():
        await run.begin()
        await train_step(run)
        await run.sync_weights()

    with pytest.raises(RuntimeError, match="engine gone while evaluating step 0"):
        asyncio.run(loop())
    assert ("push", 1) not in run.weights.syncer.events and run.monitor.logger.rows == []


def test_a_run_stopped_early_cancels_its_evaluation(tmp_path):
    run = scripted_run(tmp_path, eval_s=30.0)

    async def loop():
        await run.begin()
        await asyncio.sleep(0.01)
        await run.stop()

    asyncio.run(asyncio.wait_for(loop(), timeout=5))
    assert run.weights.syncer.events == [("eval start", 0)] and run.monitor.logger.rows == []


def test_a_failed_evaluation_is_skipped_and_training_goes_on(tmp_path):
    run = scripted_run(tmp_path, fail_at=1)  # eval.on_error = "skip" by default

    async def loop():
        await run.begin()
        for _ in range(2):
            await run.end_step(await train_step(run), 0.0)
        await run.evaluator.finish(run.version)

    asyncio.run(loop())
    evals = {step: m for step, m in run.monitor.logger.rows if "eval/accuracy" in m or "eval/skipped" in m}
    assert evals[1] == {"eval/skipped": 1.0, "eval/skipped_error": 1.0}
    assert "eval/accuracy" in evals[0] and "eval/accuracy" in evals[2]
    assert ("push", 2) in run.weights.syncer.events
    assert run.evaluator.history == [(0, 0.0), (2, pytest.approx(0.2))]


def test_a_timed_out_evaluation_is_skipped(tmp_path):
    run = scripted_run(tmp_path, None, "--fault.eval-timeout-s", "0.1", eval_s=30.0)

    async def loop():
        await run.begin()
        await train_step(run)
        await run.sync_weights()

    asyncio.run(asyncio.wait_for(loop(), timeout=10))
    assert run.monitor.logger.rows == [(0, {"eval/skipped": 1.0, "eval/skipped_timeout": 1.0})]
    assert ("push", 1) in run.weights.syncer.events
