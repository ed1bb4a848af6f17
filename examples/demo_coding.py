"""The main job behind `make demo-coding`: terminal-use coding tasks in bubblewrap sandboxes on CPU. SFT on a
scripted teacher's transcripts, then fully async GRPO with partial rollouts; prints the held-out pass rate
before SFT, after SFT and after GRPO.

The tasks are the "operators" family of `verst.sandbox.coding_tasks`: a function in project.py applies the wrong
operator and only test_project.py says the right one (`assert blend(47, 3) == 47 * 3`). The agent has a shell
tool and a file-edit tool (examples/coding/agent.py) through the session server; the reward is the fraction of
the task's hidden checks passing on the workspace at the episode's end. The teacher reads the tests, writes the
fix, runs the tests and answers. On four of the twelve functions (`FAMILIAR`), which it knows, it writes the fix
without reading the tests in three tasks of four (`SHORTCUT`), as an expert would. The student learns to take the
operator from the tests it reads, but on those functions its likelier first move is to skip the reading and
guess; an episode that reads earns the reward more often, which is what GRPO raises.

The model and data steps are skipped when their outputs exist. Extra arguments are config overrides for the
RL run (`--rollout.num-rollouts 10`).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from examples.demo import FRESH, run_rl_and_report
from verst.config import load_config
from verst.monitor.logs import configure_logging
from verst.sandbox.coding_tasks import OPERATOR_FUNCTIONS

MODEL_DIR = Path("artifacts/models/tiny-qwen3-2k")
CONTEXT_LENGTH = 2048  # a transcript that reads the tests is ~1,450 byte tokens
DATA_DIR = Path("artifacts/data/coding_demo")
N_TRAIN, N_TEST = 2400, 50
TOOLS = ("shell", "edit_file")
FAMILIAR = OPERATOR_FUNCTIONS[:4]  # the functions the teacher knows: blend, combine, merge, mix
SHORTCUT = 0.75  # of the tasks on those, the transcripts that write the fix without reading the tests
SFT_RECIPE = Path("recipes/sft_coding_demo.toml")
RL_RECIPE = Path("recipes/grpo_coding_demo.toml")


def make_artifacts(model_dir: Path = MODEL_DIR, data_dir: Path = DATA_DIR) -> None:
    """The tiny model and the tasks' splits with the teacher's transcripts, unless they exist already."""
    from examples.coding.make_data import make_data
    from verst.models.factory import init_model

    if not (model_dir / "config.json").exists():
        init_model("qwen3", "tiny", model_dir, seed=0, context_length=CONTEXT_LENGTH)
        print(f"[demo-coding] model: {model_dir}", flush=True)
    if not all((data_dir / name).exists() for name in ("train.jsonl", "test.jsonl")):
        make_data(data_dir, N_TRAIN, N_TEST, family="operators", tools=TOOLS, shortcut=SHORTCUT, familiar=FAMILIAR)
        print(f"[demo-coding] data: {data_dir} (the teacher's transcripts, made in sandboxes)", flush=True)


def main(argv: list[str] | None = None) -> int:
    from verst.schedules.sft import run_sft

    configure_logging()  # the runs' own lines (start-up, evaluations, faults)
    start = time.perf_counter()
    make_artifacts()
    sft_summary, sft_run_dir = run_sft(load_config(SFT_RECIPE, overrides=FRESH))
    before, after = sft_summary["eval/success_before"], sft_summary["eval/success_after"]
    print(f"[demo-coding] SFT warm start: held-out pass rate {before:.1%} -> {after:.1%} in "
          f"{time.perf_counter() - start:.0f} s ({sft_run_dir})", flush=True)
    overrides = ["--model.path", str(sft_run_dir / "hf"), *FRESH, *(sys.argv[1:] if argv is None else argv)]
    cfg = load_config(RL_RECIPE, overrides=overrides)
    if cfg.schedule != "fully_async" or not cfg.rollout.partial_rollout:
        raise ValueError(f"{RL_RECIPE}: the demo runs fully async with partial rollouts, got schedule = "
                         f"{cfg.schedule!r}, rollout.partial_rollout = {cfg.rollout.partial_rollout}")
    return run_rl_and_report(cfg, start, tag="demo-coding")


if __name__ == "__main__":
    sys.exit(main())
