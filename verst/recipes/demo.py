"""The main job behind `make demo`: make the tiny model and the addition data, then SFT and report.

Everything runs on CPU with locally made artifacts; each step is skipped when its output exists.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from verst.config import load_config

MODEL_DIR = Path("artifacts/models/tiny-qwen3")
DATA_DIR = Path("artifacts/data/addition")
SFT_RECIPE = Path("recipes/sft_addition.toml")


def main() -> int:
    from verst.data import make_splits, write_jsonl
    from verst.models.factory import init_model
    from verst.monitor.report import write_report
    from verst.recipes.sft import run_sft

    start = time.time()
    if not (MODEL_DIR / "config.json").exists():
        init_model("qwen3", "tiny", MODEL_DIR, seed=0)
        print(f"[demo] model: {MODEL_DIR}")
    if not (DATA_DIR / "train.jsonl").exists():
        train, test = make_splits("addition", n_train=4000, n_test=200, seed=0)
        write_jsonl(train, DATA_DIR / "train.jsonl")
        write_jsonl(test, DATA_DIR / "test.jsonl")
        print(f"[demo] data: {DATA_DIR}")
    cfg = load_config(SFT_RECIPE)
    summary, run_dir = run_sft(cfg)
    report = write_report(run_dir)
    before, after = summary["eval/accuracy_before"], summary["eval/accuracy_after"]
    print(f"[demo] held-out greedy accuracy: {before:.1%} before -> {after:.1%} after SFT")
    print(f"[demo] run directory: {run_dir}")
    print(f"[demo] report: {report}")
    print(f"[demo] finished in {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
