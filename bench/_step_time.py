"""bench/vs_trl.py --model: verst (fully async) and TRL's GRPOTrainer on the same GRPO batches of a real
model, compared in seconds per optimizer step after a warm-up, with each side's peak memory per process.

The task is single-digit sums through the model's chat template ("What is 3 + 4?" with a one-line system
prompt, numeric_match reward), 4 prompts x 8 samples, 8 new tokens at most, lr 1e-6, no KL, no group
filter (TRL trains on every group), so a run takes minutes. Both sides read one config built here; with
--lora both train the same adapters (lr 1e-4).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

SYSTEM_PROMPT = "Reply with only the number."
STEP_TARGET = 1.5  # TRL's seconds per step over verst's, at equal cores


def write_data(work_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """Train and held-out JSONL of single-digit sums (every pair; 8 held out)."""
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    paths = []
    for name, rows in (("train", pairs[8:]), ("test", pairs[:8])):
        path = work_dir / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                                            "label": str(a + b)}) + "\n" for a, b in rows))
        paths.append(path)
    return paths[0], paths[1]


def model_config(side: str, model_path: Path, args: Any):
    """The one GRPO config both sides read (the TRL side uses its model, data, batch and optimizer)."""
    from verst.config import load_config

    work_dir = Path(args.work_dir).resolve()
    train, test = write_data(work_dir)
    base = {
        "name": f"vs-trl-{side}", "run_dir": str(work_dir / side), "overwrite": True,
        "schedule": side if side != "trl" else "fully_async",
        "model": {"path": str(model_path)},
        "data": {"train_path": str(train), "test_path": str(test), "apply_chat_template": True,
                 "system_prompt": SYSTEM_PROMPT},
        "rollout": {"batch_size": args.prompts, "n_samples_per_prompt": args.samples,
                    "num_rollouts": args.warmup + args.steps, "max_response_tokens": args.max_new_tokens},
        "trainer": {"lr": 1e-6},
        "eval": {"max_prompts": 4},  # only before and after the steps: not timed
        "checkpoint": {"save": False, "export_hf": False},
        "logging": {"progress": False, "tensorboard": False, "sample_groups_per_step": 0},
    }
    if args.lora:  # both sides: rank 8, alpha 16 on every linear layer; verst pushes the adapter to its engine
        base["lora"] = {"enabled": True}
        base["trainer"] = {"lr": 1e-4}
    return load_config(None, [], base=base)


def seconds_per_step(step_times: list[float], warmup: int) -> dict[str, Any]:
    """From the wall-clock ends of steps 1..N: mean seconds per step over steps warmup+1..N, and each (a
    timed step starts where the previous one ends, so at least one warm-up step is needed)."""
    if warmup < 1 or len(step_times) <= warmup:
        raise ValueError(f"{len(step_times)} steps ran; need at least one warm-up step ({warmup}) and more steps")
    each = [b - a for a, b in zip(step_times[warmup - 1:], step_times[warmup:])]
    return {"s_per_step": sum(each) / len(each), "steps_timed": len(each), "each_s": each}


def side_main(args: Any, side: str, model_path: Path) -> dict[str, Any]:
    """Child process: run one side for warm-up + timed steps; its step end times and peak memory."""
    from _memory import PeakMemory, peak_rss_mib

    cfg = model_config(side, model_path, args)
    if side == "trl":
        import trl
        from _trl_side import run_trl

        result = run_trl(cfg, target=float("inf"), max_steps=args.warmup + args.steps, time_cap_s=args.time_cap,
                         eval_interval=0, threads=len(args.cores), out_dir=cfg.run_dir)
        result.update(version=f"trl {trl.__version__}", peak_rss_mib={"TRL process": peak_rss_mib()})
        return result
    from _verst_side import run_verst

    with PeakMemory(label="driver") as memory:
        result = run_verst(cfg, target=float("inf"), time_cap_s=args.time_cap)
    result.update(version=f"verst {cfg.schedule}", peak_rss_mib=memory.by_role())
    return result


def report(runs: list[dict[str, dict[str, Any]]], args: Any, model_path: Path) -> dict[str, Any]:
    """Print each run's seconds per step of each side, TRL's over verst's with its spread over the runs, and
    the peak memory of every process; returns the summary."""
    per_run = [{side: {**seconds_per_step(result["step_times"], args.warmup), "version": result["version"],
                       "peak_rss_mib": result["peak_rss_mib"], "threads": result["threads"],
                       "startup_s": result["step_times"][0] - result["started"]}
                for side, result in raw.items()} for raw in runs]
    tuning = "LoRA (rank 8, alpha 16, every linear layer)" if args.lora else "full fine-tuning"
    print(f"\nverst vs TRL on {model_path}, {tuning}: {args.prompts} prompts x {args.samples} samples, max "
          f"{args.max_new_tokens} new tokens, single-digit sums through the chat template; {args.warmup} warm-up steps, "
          f"then {args.steps} timed; {len(runs)} run(s); both sides on the same {len(args.cores)} cores")
    for i, summary in enumerate(per_run, 1):
        for side, s in summary.items():
            each = ", ".join(f"{x:.2f}" for x in s["each_s"])
            print(f"run {i} {side:12s} {s['s_per_step']:7.2f} s/step  (steps: {each}; launch to step 1 end "
                  f"{s['startup_s']:.1f} s; {s['version']}; threads {s['threads']})")
            print(" " * 19 + "peak RSS: " + ", ".join(f"{role} {mib:.0f} MiB" for role, mib in s["peak_rss_mib"].items()))
    ratios: dict[str, list[float]] = {}
    for summary in per_run:
        for side in (s for s in summary if s != "trl" and "trl" in summary):
            ratios.setdefault(side, []).append(summary["trl"]["s_per_step"] / summary[side]["s_per_step"])
    for side, values in ratios.items():
        mean = sum(values) / len(values)
        print(f"TRL / verst {side}, per step: {mean:.2f}x (runs: {', '.join(f'{v:.2f}' for v in values)}; spread "
              f"{min(values):.2f}-{max(values):.2f}) (target >= {STEP_TARGET}x): {'met' if mean >= STEP_TARGET else 'NOT met'}")
    print("time to the same held-out accuracy: not measured in this mode (steps, not accuracy, are compared)")
    return {"per_run": per_run, "ratios": ratios, "lora": args.lora, "target": STEP_TARGET}
