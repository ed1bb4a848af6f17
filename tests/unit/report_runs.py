"""Synthetic run directories for the report tests: a fully async RL run, a sync RL run and an SFT run,
with the metric keys the schedules log."""

from __future__ import annotations

import json
import math
from pathlib import Path

import yaml

T0 = 1_700_000_000.0


def write_run(path: Path, records: list[dict], summary: dict, config: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (path / "summary.json").write_text(json.dumps(summary))
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def rl_run(path: Path, steps: int = 30, model: str = "artifacts/models/tiny", schedule: str = "fully_async",
           samples: bool = True) -> Path:
    """A fully async run: 16 groups of 8 per step, cumulative producer and buffer counters, eval every 10."""
    records = [{"step": 0, "time": T0, "eval/accuracy": 0.5, "time/eval_s": 0.3, "time/startup/ray_s": 5.0,
                "time/startup/engines_s": 8.0, "time/startup_s": 13.0}]
    for s in range(1, steps + 1):
        records.append({
            "step": s, "time": T0 + s, "rollout/reward_mean": 0.5 + 0.01 * s + 0.05 * math.sin(s),
            "rollout/reward_std": 0.4, "perf/rollout_tokens_per_s": 1000.0 + 10 * s,
            "perf/train_tokens_per_s": 5000.0 + 20 * (s % 3), "rollout/groups_produced": 30.0 * s,
            "rollout/samples_produced": 240.0 * s, "buffer/dropped_filtered": 8.0 * s,
            "buffer/dropped_stale": 6.0 * s - 2, "buffer/dropped_aborted": 0.0, "buffer/queue_size": 2.0,
            "buffer/staleness_mean": 0.5, "buffer/staleness_max": float(s % 2), "perf/trainer_wait_s": 0.1,
            "time/train_s": 0.5, "time/logprob_s": 0.1, "sync/seconds": 0.05, "perf/step_time_s": 0.7,
            "sync/tensors": 24.0, "rollout/truncated_ratio": 0.1 if s % 2 else 0.0, "train/loss": 1.0 / s,
            "train/grad_norm": 1.0 + 0.1 * (s % 4), "sync/bytes": 2_000_000.0,
        })
        if s % 10 == 0:
            records.append({"step": s, "time": T0 + s + 0.5, "eval/accuracy": 0.5 + 0.01 * s, "time/eval_s": 0.3})
    summary = {"eval/accuracy_before": 0.5, "eval/accuracy_after": 0.5 + 0.01 * steps, "time/total_s": steps + 1.0,
               "train/steps": steps, "schedule": schedule}
    config = {"name": path.name, "schedule": schedule, "model": {"path": model},
              "rollout": {"batch_size": 16, "n_samples_per_prompt": 8, "dynamic_filter": "zero_std", "dump_dir": None},
              "trainer": {"global_batch_size": None}}
    write_run(path, records, summary, config)
    if samples:
        lines = [{"step": s, "prompt": f"What is {g} + {s}?", "response": str(g + s + (i % 2)), "reward": 1.0 - i % 2,
                  "label": str(g + s), "group": g, "status": "completed"}
                 | ({"outcome": f"tests {1 - i % 2}/1"} if g == 0 else {})  # an agent episode's end
                 for s in (1, steps // 2, steps) for g in range(5) for i in range(8)]
        (path / "samples.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def sft_run(path: Path, steps: int = 50) -> Path:
    records = [{"step": 0, "time": T0, "eval/accuracy": 0.0, "time/eval_s": 0.2}]
    records += [{"step": s, "time": T0 + 0.1 * s, "train/loss": 5.0 / s, "train/sft_loss": 5.0 / s, "train/lr": 1e-3,
                 "train/grad_norm": 1.0 + 0.1 * (s % 5), "perf/train_tokens_per_s": 6000.0 + s % 7,
                 "perf/step_time_s": 0.1} for s in range(1, steps + 1)]
    records.append({"step": steps, "time": T0 + 0.1 * steps + 1, "eval/accuracy": 0.6, "time/eval_s": 0.2})
    summary = {"eval/accuracy_before": 0.0, "eval/accuracy_after": 0.6, "train/steps": steps, "time/total_s": 6.0}
    config = {"name": path.name, "model": {"path": "artifacts/models/tiny"}, "sft": {"batch_size": 64},
              "rollout": {"batch_size": 16, "n_samples_per_prompt": 8}}
    return write_run(path, records, summary, config)
