"""Checkpoints of an RL run, as named steps of `RLRun`: save (trainer state on the ranks, rollout side in
the rollout manager, manifest and commit by the driver), resume, and the run's final model.

The pause a save causes is the ranks' copy of their shards and the rollout side's write, run at the same
time; the ranks write the shards in a background thread, and the driver's own thread waits for those
writes, then fsyncs, renames, moves `latest` and prunes; the next save waits for all of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verst.config import VerstConfig
from verst.models.loader import drop_chat_template
from verst.monitor import checkpoints as layout
from verst.monitor.run_dir import resumes_here, run_dir_of
from verst.schedules.lanes import push_adapters
from verst.trainer.backend import MERGED_LORA_DIR, export_backend, load_backend, save_backend

if TYPE_CHECKING:
    from verst.schedules.run import RLRun



@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from and its manifest."""

    step_dir: Path
    manifest: dict[str, Any]

    @property
    def version(self) -> int:
        return int(self.manifest["version"])


def prepare_resume(cfg: VerstConfig) -> ResumePoint | None:
    """`checkpoint.load` resolved and checked (complete; no unsafe field changed); a run continuing in its
    own directory keeps only the metrics rows up to the checkpoint. None when not resuming."""
    if not cfg.checkpoint.load:
        return None
    step_dir = layout.resolve(cfg.checkpoint.load)
    manifest = layout.check_resume_config(step_dir, cfg)
    if resumes_here(cfg):
        pending = manifest.get("pending_eval_step") == manifest["step"]
        layout.trim_metrics(run_dir_of(cfg), manifest["step"], drop_eval_at_step=pending)
    return ResumePoint(step_dir, manifest)


class RunCheckpointer:
    """Saves `RUN/checkpoints/step_N/` every `checkpoint.interval` steps (at rollout-batch boundaries) and
    at the end; keeps `checkpoint.keep_last`."""

    def __init__(self, cfg: VerstConfig, run_dir: Path, steps_per_rollout: int):
        self.cfg, self.run_dir, self.steps_per_rollout = cfg, Path(run_dir), steps_per_rollout
        self.last_step: int | None = None
        self._committing: concurrent.futures.Future | None = None
        self._abandoned = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verst-checkpoint")
        layout.remove_tmp_dirs(self.run_dir)

    def due(self, version: int) -> bool:
        interval = self.cfg.checkpoint.interval
        at_boundary = self.cfg.schedule == "fully_async" or version % self.steps_per_rollout == 0
        return bool(interval) and version % interval == 0 and at_boundary and version != self.last_step

    async def save(self, run: RLRun) -> float:
        """Save `run` at its version; returns the pause (seconds) before the run may go on."""
        await self.wait()
        start, version = time.perf_counter(), run.version
        tmp = layout.new_tmp_dir(self.run_dir, version)
        pending_eval = run.evaluation_in_flight()
        _, *counts = await asyncio.gather(
            asyncio.to_thread(run.trainer.apply, save_backend, str(tmp / layout.TRAINER_DIR), True),
            *(asyncio.to_thread(lane.rollout.save_state, str(tmp / lane.rollout_file)) for lane in run.lanes),
        )
        rollout_counts = counts[0] if not run.multi_lora else {lane.adapter: c for lane, c in zip(run.lanes, counts)}
        manifest = {
            "step": version, "version": version, "schedule": self.cfg.schedule,
            "eval_history": [list(entry) for entry in run.eval_history],
            "pending_eval_step": version if pending_eval else None,
            "rollout": rollout_counts, "config": self.cfg.model_dump(mode="json"),
        }
        if run.multi_lora:  # each adapter's steps and scores
            manifest["adapters"] = {lane.adapter: {"steps": lane.steps, "eval_history": [list(e) for e in lane.eval_history]}
                                    for lane in run.lanes}
        self._committing = self._pool.submit(self._commit, tmp, manifest)
        self.last_step = version
        return time.perf_counter() - start

    def _commit(self, tmp: Path, manifest: dict[str, Any]) -> None:
        """In the background: once the ranks' writes have ended, the atomic commit."""
        try:
            layout.wait_trainer_writes(tmp / layout.TRAINER_DIR, self.cfg.cluster.trainer_ranks, manifest["step"],
                                       abandoned=self._abandoned)
        except layout.CheckpointError as error:
            if self._abandoned.is_set():  # a dead rank may still hold files there; the next run removes it
                raise
            raise layout.not_saved(self.run_dir / layout.CHECKPOINTS_DIR / layout.step_dir_name(manifest["step"]),
                                   tmp, error) from error
        layout.commit(tmp, manifest, self.cfg.checkpoint.keep_last)

    async def wait(self) -> None:
        """Wait for the commit in the background, if any (its error is raised here)."""
        committing, self._committing = self._committing, None
        if committing is not None:
            await asyncio.wrap_future(committing)

    def abandon(self) -> None:
        """The run failed: a commit still waiting for the ranks' writes gives up (its temporary directory
        stays until the next run in this directory removes it; `latest` keeps the previous checkpoint)."""
        self._abandoned.set()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


async def save_checkpoint(run: RLRun) -> None:
    """Save a checkpoint and log its pause (`time/checkpoint_s`) at the run's step."""
    pause = await run.checkpointer.save(run)
    run.logger.log({"time/checkpoint_s": pause}, step=run.version)


async def restore(run: RLRun, point: ResumePoint) -> dict[str, float]:
    """Trainer state on the ranks, the rollout side's state, version, eval history; then the engines get
    the checkpoint's weights as its version before any rollout (multi-LoRA: every adapter's, by name, with
    each adapter's steps and scores). Returns the push's metrics."""
    wait_ready = getattr(run.trainer, "wait_ready", None)
    if wait_ready is not None:
        await asyncio.to_thread(wait_ready)  # the load waits behind the ranks' start-up
    steps = await asyncio.to_thread(run.trainer.apply, load_backend, str(point.step_dir / layout.TRAINER_DIR))
    if steps[0] != point.version:
        raise layout.CheckpointError(f"{point.step_dir}: trainer state is at step {steps[0]}, the manifest says "
                                     f"version {point.version}")
    for lane in run.lanes:
        await asyncio.to_thread(lane.rollout.load_state, str(point.step_dir / lane.rollout_file))
    run.version = point.version
    run.eval_history = [(int(step), float(score)) for step, score in point.manifest["eval_history"]]
    run.checkpointer.last_step = point.version
    run.resumed_pending_eval = point.manifest.get("pending_eval_step") == point.version
    if not run.multi_lora:
        run.lanes[0].steps = point.version
        metrics = await run.syncer.sync(run.version)
    else:
        saved = point.manifest.get("adapters") or {}
        if set(saved) != {lane.adapter for lane in run.lanes}:
            raise layout.CheckpointError(f"{point.step_dir} holds the adapters {sorted(saved)}; this run trains "
                                         f"{sorted(lane.adapter for lane in run.lanes)} (lora.adapters)")
        for lane in run.lanes:
            lane.steps = int(saved[lane.adapter]["steps"])
            lane.eval_history = [(int(step), float(score)) for step, score in saved[lane.adapter]["eval_history"]]
        metrics = await push_adapters(run, run.version)
    print(f"[{run.cfg.schedule}] resumed from {point.step_dir} at step {run.version}", flush=True)
    return metrics


async def finish(run: RLRun) -> None:
    """At the end of a run: the final checkpoint (`checkpoint.save`) and the final policy as a Hugging Face
    checkpoint in `RUN/hf` (`checkpoint.export_hf`; with LoRA the adapter, and the merged model in
    `RUN/hf/merged` with `checkpoint.merge_lora`)."""
    cfg = run.cfg
    if cfg.checkpoint.save and run.checkpointer.last_step != run.version:
        await save_checkpoint(run)
    await run.checkpointer.wait()
    if cfg.checkpoint.export_hf:
        hf = run.run_dir / "hf"
        await asyncio.to_thread(run.trainer.apply, export_backend, str(hf), cfg.checkpoint.merge_lora)
        _drop_untrained_template(cfg, hf)


# ---- SFT: one process (or rank actors driven from it), saved synchronously --------------------------
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
        _drop_untrained_template(cfg, run_dir / "hf")


def _drop_untrained_template(cfg: VerstConfig, hf: Path) -> None:
    """Trained on raw prompts: the export's chat template goes, so chat requests to it are refused."""
    if not cfg.data.apply_chat_template:
        drop_chat_template(hf)
        if (hf / MERGED_LORA_DIR).is_dir():
            drop_chat_template(hf / MERGED_LORA_DIR)


def restore_sft(trainer: Any, source: Any, point: ResumePoint) -> list[tuple[int, float]]:
    """Load an SFT checkpoint into `trainer` and `source`; returns its eval history."""
    trainer.load(point.step_dir / layout.TRAINER_DIR)
    if trainer.step != point.version:
        raise layout.CheckpointError(f"{point.step_dir}: trainer state is at step {trainer.step}, the manifest says "
                                     f"step {point.version}")
    source.load_state_dict(json.loads((point.step_dir / DATA_FILE).read_text()))
    print(f"[sft] resumed from {point.step_dir} at step {point.version}", flush=True)
    return [(int(step), float(score)) for step, score in point.manifest["eval_history"]]
