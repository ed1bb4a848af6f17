"""On-policy distillation vs RL alone from the same start, measured in one run.

The student is the demo's SFT warm start (`runs/sft-addition/hf`, which drops the units carry), the
teacher the demo's GRPO result (`runs/grpo-addition/hf`); `make demo` writes both. Three runs of the
demo's GRPO recipe (fully async, same data order, same step count) start from the student: RL alone
(exact-match reward), RL + OPD (`algorithm.distill_coef`), and pure OPD (`algorithm.reward_coef = 0`,
no zero-std filter: the reward is not trained on). Prints the teacher's held-out greedy accuracy and
each run's accuracy at every evaluation.
Usage: .venv/bin/python bench/opd_vs_rl.py [--steps 20] [--interval 5] [--distill-coef 1.0] [--seed 42]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "grpo_addition.toml"


def run(name: str, workdir: Path, args, *overrides: str) -> dict[int, float]:
    """One RL run of the recipe from the student; {step: held-out accuracy}."""
    from verst.config import load_config
    from verst.monitor import read_metrics
    from verst.schedules import SCHEDULES

    data = Path(args.data)
    cfg = load_config(RECIPE, [
        "--name", name, "--run-dir", str(workdir / name), "--overwrite", "--model.path", args.student,
        "--data.train-path", str(data / "train.jsonl"), "--data.test-path", str(data / "test.jsonl"),
        "--rollout.num-rollouts", str(args.steps), "--eval.interval", str(args.interval),
        "--logging.progress", "false", "--logging.tensorboard", "false", "--checkpoint.save", "false",
        "--checkpoint.export-hf", "false", "--data.seed", str(args.seed), *overrides,
    ])
    asyncio.run(SCHEDULES[cfg.schedule](cfg))
    return {r["step"]: r["eval/accuracy"] for r in read_metrics(workdir / name) if "eval/accuracy" in r}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--student", default="runs/sft-addition/hf")
    p.add_argument("--teacher", default="runs/grpo-addition/hf")
    p.add_argument("--data", default="artifacts/data/addition")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--interval", type=int, default=5)
    p.add_argument("--distill-coef", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=42, help="data.seed: the order the prompts are drawn in")
    args = p.parse_args()
    from verst.config import load_config
    from verst.eval.local import score_snapshot

    data = Path(args.data)
    eval_cfg = load_config(RECIPE, ["--data.test-path", str(data / "test.jsonl"), "--model.path", args.teacher])
    teacher = score_snapshot(eval_cfg, args.teacher, 0)["eval/accuracy"]
    distill = ["--teacher.model-path", args.teacher, "--algorithm.distill-coef", str(args.distill_coef)]
    with tempfile.TemporaryDirectory(prefix="opd-vs-rl-") as tmp:
        workdir = Path(tmp)
        curves = {
            "RL only": run("rl", workdir, args),
            "RL + OPD": run("rl-opd", workdir, args, *distill),
            "pure OPD": run("opd", workdir, args, *distill, "--algorithm.reward-coef", "0",
                            "--rollout.dynamic-filter", "null"),
        }
    steps = sorted(set.intersection(*(set(c) for c in curves.values())))
    print(f"teacher ({args.teacher}): held-out greedy accuracy {teacher:.1%}")
    print("| run | " + " | ".join(f"step {s}" for s in steps) + " |")
    print("|---|" + "---|" * len(steps))
    for name, curve in curves.items():
        print(f"| {name} | " + " | ".join(f"{curve[s]:.1%}" for s in steps) + " |")


if __name__ == "__main__":
    main()
