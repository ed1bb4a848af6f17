"""verst's side of bench/vs_trl.py: one RL schedule on the recipe's config, stopped from outside as soon
as its metrics.jsonl shows the target held-out accuracy (or at the time cap); returns its timed evaluations.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from verst.config import VerstConfig

POLL_S = 0.5  # how often the watcher reads metrics.jsonl


def evals_of(records: list[dict[str, Any]]) -> list[dict[str, float]]:
    """The timed evaluations among a run's metrics records."""
    return [{"step": r["step"], "time": r["time"], "accuracy": r["eval/accuracy"], "eval_s": r.get("time/eval_s", 0.0)}
            for r in records if "eval/accuracy" in r]


def complete_records(path: Path) -> list[dict[str, Any]]:
    """The whole lines of a metrics.jsonl that may be mid-write (the last line may be partial)."""
    if not path.exists():
        return []
    lines = path.read_text().split("\n")[:-1]  # everything before the last newline is whole
    return [json.loads(line) for line in lines if line.strip()]


async def _run_until(cfg: VerstConfig, target: float, deadline: float) -> str:
    """Run the schedule; cancel it once an evaluation after step 0 reaches `target` or at `deadline`."""
    from verst.schedules import SCHEDULES

    metrics_file = Path(cfg.run_dir) / "metrics.jsonl"
    task = asyncio.ensure_future(SCHEDULES[cfg.schedule](cfg))
    reason, shown = "step cap", 0
    while not task.done():
        await asyncio.wait({task}, timeout=POLL_S)
        if task.done():
            break
        evals = evals_of(complete_records(metrics_file))
        for e in evals[shown:]:
            print(f"[{cfg.schedule}] step {e['step']}: held-out greedy accuracy {e['accuracy']:.1%}", flush=True)
        shown = len(evals)
        if any(e["step"] > 0 and e["accuracy"] >= target for e in evals):
            reason = "target"
        elif time.time() > deadline:
            reason = "time cap"
        else:
            continue
        print(f"[{cfg.schedule}] stopping the run: {reason} reached", flush=True)
        task.cancel()  # the run's context managers stop the rollout worker, engines, trainer and Ray
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return reason
    task.result()  # re-raise a failure of the run itself
    return reason


def run_verst(cfg: VerstConfig, *, target: float, time_cap_s: float) -> dict[str, Any]:
    """Run one schedule until the target accuracy, its step cap (`rollout.num_rollouts`) or the time cap.
    The clock starts after the imports, before the run's Ray, engines and trainer start."""
    import verst.run.start  # noqa: F401  imports (torch, Ray) before the clock, as on the TRL side
    from verst.monitor import read_metrics

    if not cfg.run_dir:
        raise ValueError("run_verst needs cfg.run_dir set (the bench reads its metrics.jsonl)")
    started = time.time()
    reason = asyncio.run(_run_until(cfg, target, started + time_cap_s))
    finished = time.time()
    records = read_metrics(Path(cfg.run_dir))
    trained = [r for r in records if "train/loss" in r]
    steps = max((r["step"] for r in trained), default=0)
    return {"started": started, "finished": finished, "evals": evals_of(records), "steps": steps,
            "step_times": [r["time"] for r in sorted(trained, key=lambda r: r["step"])],
            "stopped_by": reason, "threads": threads_of(trained)}


def threads_of(trained: list[dict[str, Any]]) -> dict[str, list[float]]:
    """The torch threads each side computed with over the run (the core budget's perf/*_threads)."""
    return {side: sorted({r[f"perf/{side}_threads"] for r in trained if f"perf/{side}_threads" in r})
            for side in ("trainer", "engine")}
