"""Checkpoints of an SFT run: one process (or rank actors driven from it), saved synchronously: the
trainer's state and the data source's position; resume; the final checkpoint and Hugging Face export.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.monitor import checkpoint_dirs as layout
from verst.run.checkpointer import ResumePoint, drop_untrained_template

log = logging.getLogger(__name__)

DATA_FILE = "data.json"


def save_sft(trainer: Any, source: Any, cfg: VerstConfig, run_dir: Path, step: int,
             eval_history: list[tuple[int, float]]) -> float:
    """Save an SFT run's checkpoint at `step` (trainer state, data position); returns the seconds taken."""
    start = time.perf_counter()
    tmp = layout.new_tmp_dir(run_dir, step)
    trainer.save(tmp / layout.TRAINER_DIR)
    (tmp / DATA_FILE).write_text(json.dumps(source.state_dict()))
    manifest = {"step": step, "version": step, "schedule": "sft", "pending_eval_step": None,
                "eval_history": [list(entry) for entry in eval_history], "config": cfg.model_dump(mode="json")}
    layout.commit(tmp, manifest, cfg.checkpoint.keep_last)
    return time.perf_counter() - start


def finish_sft(trainer: Any, source: Any, cfg: VerstConfig, run_dir: Path, history: list[tuple[int, float]]) -> None:
    """The end of an SFT run: its final checkpoint (`checkpoint.save`) and Hugging Face export."""
    if cfg.checkpoint.save:
        save_sft(trainer, source, cfg, run_dir, cfg.sft.num_steps, history)
    if cfg.checkpoint.export_hf:
        trainer.export_hf(run_dir / "hf", merge_lora=cfg.checkpoint.merge_lora)
        drop_untrained_template(cfg, run_dir / "hf")


def restore_sft(trainer: Any, source: Any, point: ResumePoint) -> list[tuple[int, float]]:
    """Load an SFT checkpoint into `trainer` and `source`; returns its eval history."""
    trainer.load(point.step_dir / layout.TRAINER_DIR)
    if trainer.step != point.version:
        raise layout.CheckpointError(f"{point.step_dir}: trainer state is at step {trainer.step}, the manifest says "
                                     f"step {point.version}")
    source.load_state_dict(json.loads((point.step_dir / DATA_FILE).read_text()))
    log.info("resumed from %s at step %d", point.step_dir, point.version)
    return [(int(step), float(score)) for step, score in point.manifest["eval_history"]]
