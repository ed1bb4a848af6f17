"""`make demo-moe`: `make demo` on the tiny Qwen3-MoE (4 experts, top 2): the same addition data and recipes,
an SFT warm start of the MoE model, then fully async GRPO; prints held-out greedy accuracy before and after RL.

Command-line overrides go to the RL run, e.g. `--cluster.trainer-ranks 2 --trainer.expert-parallel-size 2
--name grpo-addition-moe-ep2` (expert parallelism, docs/parallelism.md). The model step is skipped when the
model exists, the data steps as in `make demo`.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from examples.demo import FRESH, SFT_RECIPE, make_artifacts, rl_config, run_rl_and_report
from verst.config import load_config
from verst.monitor.logs import configure_logging

MOE_MODEL_DIR = Path("artifacts/models/tiny-qwen3-moe")
SFT_NAME = "sft-addition-moe"


def main() -> int:
    from verst.models.factory import init_model
    from verst.schedules.sft import run_sft

    configure_logging()
    start = time.perf_counter()
    make_artifacts()
    if not (MOE_MODEL_DIR / "config.json").exists():
        init_model("qwen3-moe", "tiny", MOE_MODEL_DIR, seed=0)
        print(f"[demo-moe] model: {MOE_MODEL_DIR}", flush=True)
    sft_config = load_config(SFT_RECIPE, overrides=["--model.path", str(MOE_MODEL_DIR), "--name", SFT_NAME, *FRESH])
    sft_summary, sft_run_dir = run_sft(sft_config)
    print(f"[demo-moe] SFT warm start: held-out greedy accuracy {sft_summary['eval/accuracy_before']:.1%} -> "
          f"{sft_summary['eval/accuracy_after']:.1%} in {time.perf_counter() - start:.0f} s ({sft_run_dir})", flush=True)
    return run_rl_and_report(rl_config(sft_run_dir, ["--name", "grpo-addition-moe", *sys.argv[1:]]), start, "demo-moe")


if __name__ == "__main__":
    sys.exit(main())
