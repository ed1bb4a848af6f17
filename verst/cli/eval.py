"""`verst eval RUN_DIR [--step N] [--dataset PATH]`: score a run's weights at one step after the run, with an
engine of its own on 127.0.0.1, and append the score to the run's metrics.jsonl under that step.

The weights of step N are, first found first: the run's evaluation snapshot of N, its disk-transport weight
snapshot of N, its final Hugging Face export (`hf/`) when N is the last step, or its checkpoint of N
(exported to `eval_snapshots/step_N` first, by a trainer rank in this process).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

from verst.config import VerstConfig


class NoWeights(LookupError):
    """The run has no weights of the requested step in any form this command reads."""


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="verst eval", description="Score a run's weights at one step (default: its "
                                "last) and append the score to RUN_DIR/metrics.jsonl under that step.")
    p.add_argument("run_dir", metavar="RUN_DIR", help="run directory (holds config.yaml)")
    p.add_argument("--step", type=int, default=None, help="the step whose weights to score (default: the last)")
    p.add_argument("--dataset", default=None, help="held-out prompts (JSONL; default: eval.path or data.test_path)")
    p.add_argument("--max-prompts", type=int, default=None, help="default: the run's eval.max_prompts")
    args = p.parse_args(argv)
    run_dir = Path(args.run_dir)
    try:
        cfg = run_config(run_dir, args.max_prompts)
        step = last_step(run_dir) if args.step is None else args.step
        weights = find_weights(run_dir, step, cfg)
    except (NoWeights, FileNotFoundError, ValueError) as error:
        print(f"verst eval: {error}", file=sys.stderr)
        return 2
    from verst.eval.local import score_snapshot
    from verst.monitor import MetricsLogger
    from verst.monitor.logger import JsonlSink

    print(f"verst eval: scoring {weights} as step {step}", flush=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    metrics = score_snapshot(cfg, weights, step, dataset=args.dataset, log_path=run_dir / "logs" / "eval_engine.log")
    metrics["eval/offline"] = 1.0
    logger = MetricsLogger([JsonlSink(run_dir)])
    logger.log(metrics, step=step)
    logger.close()
    print(json.dumps({"step": step, **metrics}, indent=1))
    return 0


def run_config(run_dir: Path, max_prompts: int | None) -> VerstConfig:
    from verst.config import load_config

    path = run_dir / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"no config.yaml in {run_dir}; is it a run directory?")
    cfg = load_config(path)
    return cfg if max_prompts is None else cfg.model_copy(
        update={"eval": cfg.eval.model_copy(update={"max_prompts": max_prompts})})


def last_step(run_dir: Path) -> int:
    """The run's last step: summary.json's `train/steps`, else its latest checkpoint's."""
    from verst.monitor import checkpoint_dirs as layout

    summary = run_dir / "summary.json"
    if summary.is_file():
        return int(json.loads(summary.read_text())["train/steps"])
    latest = layout.read_latest(run_dir)
    if latest is None:
        raise NoWeights(f"{run_dir} has neither summary.json nor a checkpoint: give --step")
    return int(layout.read_manifest(latest)["step"])


def find_weights(run_dir: Path, step: int, cfg: VerstConfig) -> Path:
    """A Hugging Face checkpoint directory of the weights at `step` (see the module's docstring)."""
    from verst.eval.backend import snapshot_dir
    from verst.monitor import checkpoint_dirs as layout
    from verst.sync.disk import snapshot_path

    final = run_dir / "hf" / "merged" if cfg.lora.enabled else run_dir / "hf"
    candidates = [snapshot_dir(run_dir, step), snapshot_path(run_dir / "weights", step)]
    if (run_dir / "summary.json").is_file() and step == last_step(run_dir):
        candidates.append(final)
    for path in candidates:
        if (path / "config.json").is_file():
            return path
    checkpoint = layout.checkpoints_dir(run_dir) / layout.step_dir_name(step)
    if (checkpoint / layout.MANIFEST_FILE).is_file():
        return export_checkpoint(checkpoint, snapshot_dir(run_dir, step), cfg)
    found = sorted(p.name for p in layout.checkpoints_dir(run_dir).glob("step_*")) if \
        layout.checkpoints_dir(run_dir).is_dir() else []
    raise NoWeights(f"{run_dir} has no weights of step {step}: looked for {', '.join(map(str, candidates))} and "
                    f"{checkpoint} (checkpoints there: {', '.join(found) or 'none'})")


def export_checkpoint(checkpoint: Path, target: Path, cfg: VerstConfig) -> Path:
    """The checkpoint's trainer state exported as a Hugging Face checkpoint at `target`, by one trainer rank
    in this process (the state is resharded from the run's ranks)."""
    from verst.eval.backend import link_snapshot
    from verst.monitor import checkpoint_dirs as layout
    from verst.run.trainer_setup import open_trainer

    device = cfg.cluster.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    one_rank = cfg.model_copy(update={"cluster": cfg.cluster.model_copy(update={"trainer_ranks": 1, "device": device})})
    export = target.with_name(f".export-{target.name}")
    print(f"verst eval: exporting {checkpoint} to {target}", flush=True)
    with open_trainer(one_rank, total_steps=1) as backend:
        backend.load(checkpoint / layout.TRAINER_DIR)
        backend.export_hf(export, merge_lora=cfg.lora.enabled)
    link_snapshot(export / "merged" if cfg.lora.enabled else export, target)
    shutil.rmtree(export, ignore_errors=True)
    return target
