"""The main job behind `make demo`: make the tiny model and the addition data, SFT warm start, then
GRPO with the fully async schedule on CPU; prints held-out greedy accuracy before and after RL.

The warm start imitates an imperfect teacher who drops the units carry in 70% of the problems that have
one (`verst.data.teachers.forgets_carry`), as real demonstrations carry their authors' habits; GRPO with
the exact-match reward on the true sums then removes the habit. Held-out labels are always correct.

Everything runs on CPU with locally made artifacts; the model and data steps are skipped when their
outputs exist. The RL run's `summary.json` holds `eval/accuracy_before` and `eval/accuracy_after`.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verst.config import VerstConfig, load_config
from verst.monitor.logs import configure_logging

MODEL_DIR = Path("artifacts/models/tiny-qwen3")
# task -> its data folder: train.jsonl and test.jsonl (true labels) and sft_teacher.jsonl (the train
# prompts with the teacher's labels). `chain_addition` is bench/vs_trl.py's long-tailed variant.
TASK_DATA = {"addition": Path("artifacts/data/addition"), "chain_addition": Path("artifacts/data/chain_addition")}
SFT_DATA_NAME = "sft_teacher.jsonl"
TEACHER_CARRY_ERROR_RATE = 0.7
SFT_RECIPE = Path("recipes/sft_addition.toml")
RL_RECIPE = Path("recipes/grpo_addition.toml")
FRESH = ["--overwrite"]  # each demo replaces the previous demo's run directories


def make_artifacts(task: str = "addition") -> Path:
    """The tiny model, the task's splits and the teacher's SFT data, unless they exist already; returns
    the task's data folder."""
    from verst.data import make_splits, write_jsonl
    from verst.data.teachers import forgets_carry
    from verst.models.factory import init_model

    if task not in TASK_DATA:
        raise ValueError(f"make_artifacts: unknown task {task!r}; choose from {sorted(TASK_DATA)}")
    if not (MODEL_DIR / "config.json").exists():
        init_model("qwen3", "tiny", MODEL_DIR, seed=0)
        print(f"[demo] model: {MODEL_DIR}", flush=True)
    data_dir = TASK_DATA[task]
    if not all((data_dir / name).exists() for name in ("train.jsonl", "test.jsonl", SFT_DATA_NAME)):
        train, test = make_splits(task, n_train=4000, n_test=200, seed=0)
        write_jsonl(train, data_dir / "train.jsonl")
        write_jsonl(test, data_dir / "test.jsonl")
        write_jsonl(forgets_carry(train, TEACHER_CARRY_ERROR_RATE, seed=0), data_dir / SFT_DATA_NAME)
        print(f"[demo] data: {data_dir}", flush=True)
    return data_dir


def rl_config(sft_run_dir: Path, overrides: Sequence[str] = ()) -> VerstConfig:
    """The GRPO recipe, starting from the SFT run's Hugging Face export; `overrides`: the command line's, for
    the RL run (e.g. `--cluster.trainer-ranks 2 --trainer.tensor-parallel-size 2 --cluster.device cpu`)."""
    hf = sft_run_dir / "hf"
    if not (hf / "config.json").exists():
        raise FileNotFoundError(f"the SFT run exported no Hugging Face model at {hf} (checkpoint.export_hf off?)")
    return load_config(RL_RECIPE, overrides=["--model.path", str(hf), *FRESH, *overrides])


def check_rl_summary(summary: dict[str, Any], score: str = "eval/accuracy") -> tuple[float, float]:
    """The held-out `score` before and after RL; fails loudly when RL took no step or measured nothing."""
    steps = summary.get("train/steps", 0)
    if not steps:
        raise RuntimeError(f"RL did not run: summary train/steps = {steps!r}")
    missing = [k for k in (f"{score}_before", f"{score}_after") if k not in summary]
    if missing:
        raise RuntimeError(f"RL summary lacks {missing}: {sorted(summary)}")
    return summary[f"{score}_before"], summary[f"{score}_after"]


def main() -> int:
    from verst.schedules.sft import run_sft

    configure_logging()  # the runs' own lines (start-up, evaluations, faults)
    start = time.perf_counter()
    make_artifacts()
    sft_summary, sft_run_dir = run_sft(load_config(SFT_RECIPE, overrides=FRESH))
    sft_s = time.perf_counter() - start
    cfg = rl_config(sft_run_dir, sys.argv[1:])
    if cfg.schedule != "fully_async":
        raise ValueError(f"{RL_RECIPE}: the demo runs the fully async schedule, got schedule = {cfg.schedule!r}")
    print(f"[demo] SFT warm start: held-out greedy accuracy {sft_summary['eval/accuracy_before']:.1%} -> "
          f"{sft_summary['eval/accuracy_after']:.1%} in {sft_s:.0f} s ({sft_run_dir})", flush=True)
    return run_rl_and_report(cfg, start)


def run_rl_and_report(cfg: VerstConfig, start: float, tag: str = "demo") -> int:
    """Runs the fully async RL job of a demo and prints its held-out score (greedy accuracy, or agent success
    for a tool-using task) before and after, the summary's and the report's paths and the time since `start`;
    1 when RL took no step or measured nothing."""
    from verst.eval.agentic import SCORE_WORDS, score_key
    from verst.schedules import SCHEDULES

    summary = asyncio.run(SCHEDULES[cfg.schedule](cfg))
    score = score_key(cfg)
    try:
        before, after = check_rl_summary(summary, score)
    except RuntimeError as err:
        print(f"[{tag}] {err}", file=sys.stderr, flush=True)
        return 1
    run_dir = Path(cfg.run_dir or Path("runs") / cfg.name)
    print(f"[{tag}] GRPO (fully async, {summary['train/steps']} steps): held-out greedy {SCORE_WORDS[score]} "
          f"{before:.1%} before RL -> {after:.1%} after RL ({after - before:+.1%})")
    print(f"[{tag}] summary: {run_dir / 'summary.json'}")
    print(f"[{tag}] report: {run_dir / 'report.html'}")
    print(f"[{tag}] finished in {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
