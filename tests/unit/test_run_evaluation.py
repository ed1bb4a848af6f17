"""Held-out evaluations in the background of an RL run: each scores the version the engines serve when it
starts, the weights do not change under it, and its row is logged at its own step, in step order."""

from __future__ import annotations

import asyncio
import io

import pytest

from verst.config import batch_plan, load_config
from verst.monitor.progress import RunProgress
from verst.schedules.run import RLRun


class Logger:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))


class Syncer:
    """Records, at every push, which evaluations were still running."""

    def __init__(self, events):
        self.version, self.events = 0, events

    def due(self, version):
        return True

    async def sync(self, version):
        self.events.append(("push", version))
        await asyncio.sleep(0)
        self.version = version
        return {"sync/version": float(version)}


class IdleMeter:
    async def read(self):
        return None


class ScriptedRun(RLRun):
    """An RLRun whose evaluation takes `eval_s` and records when it starts and ends."""

    eval_s = 0.05
    fail_at: int | None = None

    async def evaluate(self, step=None):
        step, version = self.version if step is None else step, self.syncer.version
        self.syncer.events.append(("eval start", version))
        await asyncio.sleep(self.eval_s)
        if step == self.fail_at:
            raise RuntimeError(f"engine gone while evaluating step {step}")
        self.syncer.events.append(("eval end", version))
        return {"eval/accuracy": 0.1 * step, "eval/weight_version": float(version)}


def scripted_run(out=None, *overrides) -> ScriptedRun:
    cfg = load_config(None, ["--eval.interval", "1", *overrides])
    events: list = []
    progress = RunProgress("sync", 3, mode="lines" if out else "off", stream=out)
    return ScriptedRun(cfg, batch_plan(cfg), None, Logger(), None, None, None, Syncer(events), "", IdleMeter(),
                       progress)


async def train_step(run: RLRun) -> None:
    run.version += 1  # what RLRun.train does after each optimizer step
    await asyncio.sleep(0.01)


def test_an_evaluation_overlaps_the_next_step_and_the_push_waits_for_it():
    out = io.StringIO()
    run = scripted_run(out)

    async def loop():
        await run.start_evaluation({"time/startup_s": 1.5})
        for _ in range(3):
            await train_step(run)  # trains while the previous version is evaluated
            await run.sync_weights()
            await run.log({"train/loss": 0.5}, step_start=0.0)
            await run.start_evaluation()
        await run.evaluate_last_version()

    asyncio.run(loop())
    events = run.syncer.events
    # the weights never change under an evaluation: every push comes after the evaluation before it ended
    assert events == [("eval start", 0), ("eval end", 0), ("push", 1), ("eval start", 1), ("eval end", 1),
                      ("push", 2), ("eval start", 2), ("eval end", 2), ("push", 3), ("eval start", 3),
                      ("eval end", 3)]
    steps = [(step, "eval/accuracy" in m) for step, m in run.logger.rows]
    assert steps == [(0, True), (1, False), (1, True), (2, False), (2, True), (3, False), (3, True)]
    assert run.logger.rows[0][1]["time/startup_s"] == 1.5  # start-up goes with the step-0 evaluation
    assert [m["eval/weight_version"] for _, m in run.logger.rows if "eval/accuracy" in m] == [0, 1, 2, 3]
    assert run.eval_history == [(0, 0.0), (1, 0.1), (2, pytest.approx(0.2)), (3, pytest.approx(0.3))]
    assert "[sync] step 2 evaluated: eval 20.0%" in out.getvalue().splitlines()
    assert run.progress.last_eval == {"eval/accuracy": pytest.approx(0.3)}


def test_the_last_version_is_evaluated_once():
    run = scripted_run()

    async def loop():
        await train_step(run)
        await run.start_evaluation()
        await run.evaluate_last_version()  # already being measured: waits for it, no second evaluation
        await train_step(run)
        await run.evaluate_last_version()

    asyncio.run(loop())
    assert [step for step, m in run.logger.rows] == [1, 2]
    assert [e for e in run.syncer.events if e[0] == "eval start"] == [("eval start", 0), ("eval start", 0)]


def test_a_failed_evaluation_stops_the_run_at_the_next_push_under_on_error_stop():
    run = scripted_run(None, "--eval.on-error", "stop")
    run.fail_at = 0

    async def loop():
        await run.start_evaluation()
        await train_step(run)
        await run.sync_weights()

    with pytest.raises(RuntimeError, match="engine gone while evaluating step 0"):
        asyncio.run(loop())
    assert ("push", 1) not in run.syncer.events and run.logger.rows == []


def test_a_run_stopped_early_cancels_its_evaluation():
    run = scripted_run()
    run.eval_s = 30.0

    async def loop():
        await run.start_evaluation()
        await asyncio.sleep(0.01)
        await run.drop_evaluation()

    asyncio.run(asyncio.wait_for(loop(), timeout=5))
    assert run.syncer.events == [("eval start", 0)] and run.logger.rows == []



def test_a_failed_evaluation_is_skipped_and_training_goes_on():
    run = scripted_run()  # eval.on_error = "skip" by default
    run.fail_at = 1

    async def loop():
        await run.start_evaluation()
        for _ in range(2):
            await train_step(run)
            await run.sync_weights()
            await run.log({"train/loss": 0.5}, step_start=0.0)
            await run.start_evaluation()
        await run.evaluate_last_version()

    asyncio.run(loop())
    evals = {step: m for step, m in run.logger.rows if "eval/accuracy" in m or "eval/skipped" in m}
    assert evals[1] == {"eval/skipped": 1.0, "eval/skipped_error": 1.0}
    assert "eval/accuracy" in evals[0] and "eval/accuracy" in evals[2]
    assert ("push", 2) in run.syncer.events and run.eval_history == [(0, 0.0), (2, pytest.approx(0.2))]


def test_a_timed_out_evaluation_is_skipped():
    run = scripted_run(None, "--fault.eval-timeout-s", "0.1")
    run.eval_s = 30.0

    async def loop():
        await run.start_evaluation()
        await train_step(run)
        await run.sync_weights()

    asyncio.run(asyncio.wait_for(loop(), timeout=10))
    assert run.logger.rows == [(0, {"eval/skipped": 1.0, "eval/skipped_timeout": 1.0})]
    assert ("push", 1) in run.syncer.events
