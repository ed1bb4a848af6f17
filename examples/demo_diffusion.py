"""The job behind `make demo-diffusion`: the shapes classifier, the pretrained denoiser and the prompt files
(each skipped when it exists), then Flow-GRPO through `verst train`'s loop (recipes/flow_grpo_shapes.toml);
prints the held-out classifier accuracy and mean reward before and after RL, the report and the image grids.
Command-line arguments go to the RL run (`--rollout.num-rollouts 40`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

from verst.config import load_config
from verst.monitor import read_metrics
from verst.monitor.image_grid import eval_grids
from verst.monitor.logs import configure_logging

ARTIFACTS = Path("artifacts/diffusion")
RECIPE = Path("recipes/flow_grpo_shapes.toml")


def make_artifacts() -> None:
    """The classifier, the pretrained base and the prompt files, unless they exist."""
    from verst.cli.diffusion import main as diffusion

    if not (ARTIFACTS / "classifier.pt").exists():
        diffusion(["classifier", "--out", str(ARTIFACTS / "classifier.pt")])
    if not (ARTIFACTS / "base" / "config.json").exists():
        diffusion(["pretrain", "--out", str(ARTIFACTS / "base")])
    if not (ARTIFACTS / "prompts" / "test.jsonl").exists():
        diffusion(["prompts", "--out", str(ARTIFACTS / "prompts")])


def main(argv: list[str]) -> int:
    from verst.schedules import SCHEDULES

    configure_logging()
    start = time.perf_counter()
    make_artifacts()
    prepared = time.perf_counter() - start
    cfg = load_config(RECIPE, overrides=["--overwrite", *argv])
    summary = asyncio.run(SCHEDULES[cfg.schedule](cfg))
    run_dir = Path(cfg.run_dir or Path("runs") / cfg.name)
    evals = [r for r in read_metrics(run_dir) if "eval/reward/correct" in r]
    if not summary.get("train/steps") or len(evals) < 2:
        print(f"[demo-diffusion] RL did not run or measured nothing: {summary.get('train/steps')} steps, "
              f"{len(evals)} evaluations", file=sys.stderr)
        return 1
    first, last = evals[0], evals[-1]
    grids = eval_grids(run_dir)
    print(f"[demo-diffusion] Flow-GRPO ({cfg.schedule}, {summary['train/steps']} steps): held-out classifier "
          f"accuracy {first['eval/reward/correct']:.1%} (step {first['step']}) -> {last['eval/reward/correct']:.1%} "
          f"(step {last['step']}), {100 * (last['eval/reward/correct'] - first['eval/reward/correct']):+.1f} points; "
          f"mean reward {first['eval/accuracy']:.3f} -> {last['eval/accuracy']:.3f}")
    print(f"[demo-diffusion] held-out images: {grids[first['step']]} and {grids[last['step']]}")
    print(f"[demo-diffusion] report: {run_dir / 'report.html'}")
    print(f"[demo-diffusion] finished in {time.perf_counter() - start:.0f} s "
          f"({prepared:.0f} s for the classifier, the base and the prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
