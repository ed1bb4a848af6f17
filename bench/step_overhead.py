"""The time of an RL step that is neither engine compute nor train compute, per schedule, on the tiny model
(docs/scale.md, "Step overhead"). Each schedule runs make demo's GRPO recipe (recipes/grpo_addition.toml: 16
prompts x 8 samples, 5 new tokens at most) on a tiny Qwen3 made in the work directory, with no group filter
(an untrained model's groups would all be filtered) and no evaluation between the first and the last step.

From the run's metrics, per step after the warm-up (medians over the steps):
    step          perf/step_time_s, the trainer's wall time of the step
    period        the wall time between this step's log record and the previous one's: the step plus what the
                  driver does after timing it (reading the engines' busy time, logging) and before the next
    engine        engine compute: (1 - perf/engine_idle_fraction) x period, the time the engine had requests running
    train         time/train_s, the train step on the trainer (old-policy logprobs included)
    sync          sync/seconds, the weight push
    rollout_glue  time/rollout_s - engine: dispatch, reward and batching around the engine's work (sync only,
                  where the rollout is a phase of the step)
    other         period - rollout - train - sync (sync), the driver's own time between the phases
    overhead      what is neither engine nor train compute: period - engine - train on the sync schedule, where
                  they take turns; period - max(engine, train) on the others, where they overlap

    .venv/bin/python bench/step_overhead.py [--schedules sync one_step_off fully_async] [--steps 30] [--warmup 5] \
        [--request-per sample|group]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPE = ROOT / "recipes" / "grpo_addition.toml"
TARGET_S = 0.030  # docs/scale.md: at most 30 ms a step outside engine and train compute
SCHEDULES = ("sync", "one_step_off", "fully_async")


def make_inputs(work_dir: Path) -> tuple[Path, Path, Path]:
    """The tiny model and the addition splits in `work_dir` (made once)."""
    from verst.data import make_splits, write_jsonl
    from verst.models.factory import init_model

    model, train, test = work_dir / "model", work_dir / "train.jsonl", work_dir / "test.jsonl"
    if not (model / "config.json").is_file():
        init_model("qwen3", "tiny", model, seed=0)
    if not train.is_file():
        rows, held_out = make_splits("addition", n_train=4000, n_test=32, seed=0)
        write_jsonl(rows, train)
        write_jsonl(held_out, test)
    return model, train, test


def run_schedule(schedule: str, steps: int, work_dir: Path, request_per: str = "sample") -> list[dict[str, Any]]:
    """One run of `schedule` for `steps` steps (one engine request per sample, or per group); its metrics records."""
    from bench._scale_run import request_per_args
    from verst.config import load_config
    from verst.monitor import read_metrics
    from verst.schedules import SCHEDULES as LOOPS

    model, train, test = make_inputs(work_dir)
    run_dir = work_dir / f"run-{schedule}-{request_per}"
    cfg = load_config(RECIPE, [
        "--model.path", str(model), "--data.train-path", str(train), "--data.test-path", str(test),
        "--schedule", schedule, "--rollout.num-rollouts", str(steps), "--rollout.dynamic-filter", "null",
        "--eval.interval", "0", "--eval.max-prompts", "8", "--run-dir", str(run_dir), "--overwrite",
        "--logging.progress", "false", "--logging.tensorboard", "false", *request_per_args(request_per)])
    asyncio.run(LOOPS[schedule](cfg))
    return read_metrics(run_dir)


def breakdown(schedule: str, records: list[dict[str, Any]], warmup: int) -> dict[str, Any]:
    """The per-step phases (module docstring) after `warmup` steps, each the median over the steps."""
    steps = [r for r in records if "perf/step_time_s" in r]
    previous = {r["step"]: p["time"] for p, r in zip(steps, steps[1:], strict=False)}
    rows = [r for r in steps if r["step"] > warmup and r["step"] in previous]
    if not rows:
        raise RuntimeError(f"{schedule}: no step after the warm-up of {warmup} logged perf/step_time_s")
    phases: dict[str, list[float]] = {}
    for r in rows:
        period = r["time"] - previous[r["step"]]
        engine = (1.0 - r.get("perf/engine_idle_fraction", 1.0)) * period  # the idle fraction spans the period
        train, sync = r.get("time/train_s", 0.0), r.get("sync/seconds", 0.0)
        values = {"step": r["perf/step_time_s"], "period": period, "engine": engine, "train": train, "sync": sync}
        if schedule == "sync":
            rollout = r.get("time/rollout_s", 0.0)
            values |= {"rollout_glue": rollout - engine, "other": period - rollout - train - sync,
                       "overhead": period - engine - train}
        else:
            values |= {"overhead": period - max(engine, train)}
        for key, value in values.items():
            phases.setdefault(key, []).append(value)
    return {"steps": len(rows), **{k: statistics.median(v) for k, v in phases.items()}}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the medians")
    parser.add_argument("--request-per", choices=["sample", "group"], default="sample", help="rollout.request_per")
    parser.add_argument("--work-dir", help="default: a new temporary directory")
    parser.add_argument("--out", help="write the results here as JSON")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    work_dir = Path(args.work_dir or tempfile.mkdtemp(prefix="verst-step-overhead-")).resolve()
    load_before = os.getloadavg()[0]
    results = {}
    for schedule in args.schedules:
        started = time.perf_counter()
        records = run_schedule(schedule, args.steps, work_dir, args.request_per)
        results[schedule] = breakdown(schedule, records, args.warmup)
        results[schedule]["wall_s"] = time.perf_counter() - started
    keys = ("step", "period", "engine", "train", "sync", "rollout_glue", "other", "overhead")
    print(f"ms per step, one engine request per {args.request_per}, median over steps {args.warmup + 1}-{args.steps} "
          f"(load average {load_before:.1f} before, "
          f"{os.getloadavg()[0]:.1f} after); target: overhead <= {TARGET_S * 1000:.0f} ms")
    print(f"{'schedule':14}" + "".join(f"{k:>14}" for k in keys))
    for schedule, r in results.items():
        cells = "".join(f"{r[k] * 1000:14.1f}" if k in r else f"{'-':>14}" for k in keys)
        print(f"{schedule:14}{cells}   {'meets' if r['overhead'] <= TARGET_S else 'misses'} the target")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
