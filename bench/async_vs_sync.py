"""Sync vs fully async RL under long-tailed response lengths, measured in one run.

Both schedules run the same tiny model, task, batch shape and step count on local Ray; a generate fn
(loaded by import path from this file) forces long-tailed lengths: most responses are short, a few
run to 128 tokens (ignore_eos). Both get the same cores (`--cores N`, default all), which verst's core budget
divides (sync: trainer and engine each alone on all of them in turn; fully async: split between the two).
Prints the mean step time of each (first step excluded), their ratio (target: fully async ≥ 2.5× faster),
the threads each side had, and the engine idle fraction of each (`perf/engine_idle_fraction`:
1 − the share of wall time the engines spent in forward steps, read from the engines themselves), the
fully async worker's idle slot fraction, and how busy the cores were during the timed steps with the CPU
milliseconds a step of each process (trainer rank, engine, rollout manager, driver, Ray's own). The fully
async worker keeps two batches of trajectories in flight by default (the sync schedule has one batch in
flight by construction): while a straggler runs, the engine's batches stay full of the next groups instead
of shrinking to the straggler.
With `--max-staleness K` the fully async side drops groups older than K versions, and prints the share of the
groups it produced that were dropped as stale (`--admission fill` starts groups regardless of their staleness).
Usage: .venv/bin/python bench/async_vs_sync.py [--rollouts 48] [--batch 8] [--n 4] [--max-in-flight 64]
    [--cores N] [--max-staleness K] [--admission auto|staleness|fill] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from _cores import bench_cores, describe, pin_here  # noqa: E402
from _cpu import CpuMeter  # noqa: E402

TAIL = ((75, 4), (20, 32), (5, 128))  # (% of samples, response tokens)
TARGET = 2.5  # fully async over sync, step time, at equal cores


def long_tail_length(index: int) -> int:
    """Deterministic long tail over the sample index (see TAIL)."""
    u, edge = zlib.crc32(str(index).encode()) % 100, 0
    for share, tokens in TAIL:
        edge += share
        if u < edge:
            return tokens
    raise AssertionError(f"TAIL shares sum to {edge}, not 100")


async def long_tailed_generate(ctx, sample):
    """The default generate fn with a per-sample response length and eos ignored."""
    from verst.rollout.generate import generate

    rollout = ctx.rollout.model_copy(update={"max_response_tokens": long_tail_length(sample.index)})
    params = {**(ctx.sampling_params or {}), "ignore_eos": True}
    return await generate(dataclasses.replace(ctx, rollout=rollout, sampling_params=params), sample)


def fully_async_args(args) -> list[str]:
    staleness = ["--buffer.max-staleness", str(args.max_staleness)] if args.max_staleness is not None else []
    return ["--rollout.admission", args.admission, *staleness]


def run(schedule: str, workdir: Path, model: Path, data: Path, args, cpu: CpuMeter) -> dict[str, float]:
    from verst.config import load_config
    from verst.monitor import read_metrics
    from verst.schedules import SCHEDULES

    cfg = load_config(None, [
        "--name", schedule, "--run-dir", str(workdir / schedule), "--overwrite", "--schedule", schedule,
        "--model.path", str(model), "--data.train-path", str(data / "train.jsonl"),
        "--data.test-path", str(data / "test.jsonl"), "--data.apply-chat-template", "false",
        "--rollout.batch-size", str(args.batch), "--rollout.n-samples-per-prompt", str(args.n),
        "--rollout.num-rollouts", str(args.rollouts), "--rollout.max-response-tokens", "128",
        "--rollout.generate-fn", "async_vs_sync:long_tailed_generate",
        "--trainer.lr", "1e-5", "--eval.max-prompts", "4", "--logging.tensorboard", "false",
        "--logging.progress", "false",
        "--rollout.max-in-flight", str(args.max_in_flight), *(fully_async_args(args) if schedule == "fully_async" else []),
    ])
    asyncio.run(SCHEDULES[schedule](cfg))
    steps = [r for r in read_metrics(Path(cfg.run_dir)) if "train/loss" in r][1:]
    step_s = statistics.fmean(r["perf/step_time_s"] for r in steps)
    idle = statistics.fmean(r["perf/engine_idle_fraction"] for r in steps)
    slots = statistics.fmean(1.0 - r["rollout/slot_occupancy"] for r in steps) if schedule == "fully_async" else None
    tokens = statistics.fmean(r["rollout/response_length_mean"] for r in steps)
    threads = {side: sorted({r[f"perf/{side}_threads"] for r in steps}) for side in ("trainer", "engine")}
    last = steps[-1]
    produced, stale = last.get("rollout/groups_produced_total"), last.get("buffer/dropped_stale_total", 0.0)
    window = cpu.between(steps[0]["time"], last["time"])  # the timed steps after the first of them
    return {"step_s": step_s, "idle": idle, "idle_slots": slots, "response_length_mean": tokens,
            "steps": len(steps), "threads": threads, "groups_produced": produced,
            "stale_dropped": stale if produced is not None else None,
            "cpu": window.row(len(steps) - 1), "cpu_line": window.line(len(steps) - 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=48,
                        help="steps per schedule, the first excluded (enough that a few slow steps do not decide the mean)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-in-flight", type=int, default=None,
                        help="fully async: trajectories in flight (default: 2 × batch × n)")
    parser.add_argument("--keep", type=Path, default=None, help="write the two runs here instead of a temp dir")
    parser.add_argument("--cores", type=int, default=None, help="CPU cores both schedules get (default: all)")
    parser.add_argument("--max-staleness", type=int, default=None,
                        help="fully async: buffer.max_staleness (default: unset, no group is stale)")
    parser.add_argument("--admission", choices=("auto", "staleness", "fill"), default="auto",
                        help="fully async: rollout.admission (auto: staleness-aware when --max-staleness is set)")
    parser.add_argument("--out", type=Path, default=None, help="write the measurements as JSON here")
    args = parser.parse_args()
    cores = bench_cores(args.cores)
    pin_here(cores)  # before Ray starts: its workers inherit the cores
    args.max_in_flight = args.max_in_flight or 2 * args.batch * args.n
    # The rollout manager actor imports the generate fn by path: make this directory importable there.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))
    from verst.data import make_splits, write_jsonl
    from verst.models import init_model
    from verst.orchestration import RaySession

    with tempfile.TemporaryDirectory() as tmp, RaySession(slots=4, log_to_driver=False), CpuMeter(len(cores)) as cpu:
        work = args.keep or Path(tmp)
        model = init_model("qwen3", "tiny", work / "model", seed=0)
        train, test = make_splits("addition", n_train=500, n_test=20, seed=0)
        write_jsonl(train, work / "data" / "train.jsonl")
        write_jsonl(test, work / "data" / "test.jsonl")
        results = {s: run(s, work, model, work / "data", args, cpu) for s in ("sync", "fully_async")}
    tail = ", ".join(f"{share}% {tokens}" for share, tokens in TAIL)
    print(f"\nlong-tailed lengths ({tail} tokens), {args.batch} prompts x {args.n} samples, "
          f"{args.rollouts} steps (first excluded), fully async max_in_flight {args.max_in_flight}; both schedules "
          f"on {describe(cores)}, divided by verst's core budget (sync: each side alone on all of them; fully "
          "async: split between trainer and engine)")
    for schedule, r in results.items():
        slots = f"   idle slot fraction {r['idle_slots']:.2f}" if r["idle_slots"] is not None else ""
        threads = ", ".join(f"{side} {'/'.join(f'{t:.0f}' for t in ts)}" for side, ts in r["threads"].items())
        stale = f"   stale drops {r['stale_dropped']:.0f} of {r['groups_produced']:.0f} groups produced " \
            f"({r['stale_dropped'] / max(r['groups_produced'], 1):.1%})" if r["stale_dropped"] is not None else ""
        print(f"{schedule:<12} step {r['step_s']:.2f} s   engine idle fraction {r['idle']:.2f}{slots}   "
              f"mean response {r['response_length_mean']:.1f} tokens   threads: {threads}{stale}")
        print(f"{'':<12} {r['cpu_line']}")
    ratio = results["sync"]["step_s"] / results["fully_async"]["step_s"]
    print(f"ratio sync / fully async step time: {ratio:.2f}x  (target >= {TARGET}x)")
    if args.out:
        args.out.write_text(json.dumps({"cores": list(cores), "ratio": ratio, "target": TARGET, **results,
                                        "args": {k: str(v) for k, v in vars(args).items()}}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    from _memory import report_peaks  # this script's folder is first on sys.path

    sys.exit(report_peaks(main))
