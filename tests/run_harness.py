"""An RL run assembled by `verst.run.start.assemble` over stand-in handles: the real parts (rollouts, trainer
group, weight push, evaluator, checkpointer, monitor) with no Ray, engine or trainer, for unit tests of how
the loop's steps interleave (evaluations, pushes, rows), and a scripted evaluation to drive them."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from verst.config import batch_plan, load_config
from verst.orchestration import TrainBatchRef
from verst.run.rl_run import RLRun
from verst.run.start import Actors, assemble
from verst.trainer.rl_steps import train_adapter_step, train_rollout_step


class Logger:
    def __init__(self):
        self.rows: list[tuple[int, dict]] = []

    def log(self, metrics, step):
        self.rows.append((step, dict(metrics)))


class Syncer:
    """Rank 0's syncer: records every push in `events` (shared with a scripted evaluation)."""

    def __init__(self, events: list | None = None):
        self.version, self.events = 0, [] if events is None else events

    def due(self, version):
        return True

    async def sync(self, version, **options):
        self.events.append(("push", version))
        await asyncio.sleep(0)
        self.version = version
        return {"sync/version": float(version)}

    async def close(self):
        pass

    async def close_within(self, seconds):
        pass


class Ranks:
    """The trainer ranks: a train step returns a loss; an export writes a small checkpoint directory."""

    infos: list[dict] = []

    def __init__(self):
        self.exports: list[str] = []

    def apply(self, fn, *args):
        if fn in (train_rollout_step, train_adapter_step):
            return [{"train/loss": 0.5}]
        return [fn(self, *args)]

    def export_hf(self, directory, merge_lora=False):
        self.exports.append(directory)
        Path(directory).mkdir(parents=True)
        (Path(directory) / "config.json").write_text("{}")


class Manager:
    router_url = None


def harness_run(tmp_path: Path, *overrides: str, fleet: Any = None, logger: Any = None,
                ranks: Any = None, manager: Any = None) -> RLRun:
    """A run of `--eval.interval 1` and `overrides` over the stand-ins (`run.monitor.logger.rows`,
    `run.weights.syncer.events`, `run.trainer.ranks.exports`), in `tmp_path / "run"`."""
    cfg = load_config(None, ["--eval.interval", "1", "--run-dir", str(tmp_path / "run"), *overrides])
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    actors = Actors(ranks or Ranks(), None, None, None, {None: manager or Manager()}, {})
    return assemble(cfg, batch_plan(cfg), tmp_path / "run", actors, Syncer(), None, None, fleet,
                    Logger() if logger is None else logger, idle_meter=None, router_url="http://127.0.0.1:9",
                    restarts=0, started=time.perf_counter(), started_at=time.time())


async def train_step(run: RLRun) -> dict[str, float]:
    """One optimizer step on a stand-in batch (the trainer's version goes up; nothing is pushed)."""
    async for metrics in run.train(TrainBatchRef(None, run.plan.groups_per_train_step)):
        return metrics
    raise AssertionError("no step")


def script_evaluation(run: RLRun, eval_s: float = 0.05, fail_at: int | None = None, versioned: bool = False) -> None:
    """Replace the evaluation's scoring: it takes `eval_s`, records ("eval start"/"eval end", served version)
    in the syncer's events, fails at step `fail_at`, and scores 0.1 × step as the served version (`versioned`:
    0.5, reporting the served version, which may not be the step's)."""
    events = run.weights.syncer.events

    async def evaluate(step: int) -> dict[str, float]:
        version = run.weights.version
        events.append(("eval start", version))
        await asyncio.sleep(eval_s)
        if step == fail_at:
            raise RuntimeError(f"engine gone while evaluating step {step}")
        events.append(("eval end", version))
        if versioned:
            return {"eval/accuracy": 0.5, "eval/weight_version": float(version)}
        return {"eval/accuracy": 0.1 * step, "eval/weight_version": float(version)}

    run.evaluator.evaluate = evaluate
