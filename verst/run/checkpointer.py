"""Checkpoints of an RL run: save (trainer state on the ranks, rollout side in the rollout manager, manifest
and commit by the driver), resume, and the run's final model.

The pause a save causes is the ranks' copy of their shards and the rollout side's write, run at the same
time; the ranks write the shards in a background thread, and the driver's own thread waits for those
writes, then fsyncs, renames, moves `latest` and prunes; the next save waits for all of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import threading
import time
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.models.loader import drop_chat_template
from verst.monitor import checkpoint_dirs as layout
from verst.monitor.diagnosis import cause_text
from verst.monitor.run_dir import resumes_here, run_dir_of
from verst.run.rollouts import Rollouts
from verst.trainer.backend import MERGED_LORA_DIR, TrainerRanks, export_backend, load_backend, save_backend

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run continues from and its manifest."""

    step_dir: Path
    manifest: dict[str, Any]

    @property
    def version(self) -> int:
        return int(self.manifest["version"])


def prepare_resume(cfg: VerstConfig) -> ResumePoint | None:
    """`checkpoint.load` resolved and checked (complete; no unsafe field changed; a changed trainer mesh logged
    with what it keeps exact); a run continuing in its own directory keeps only the metrics rows up to the
    checkpoint. None when not resuming."""
    if not cfg.checkpoint.load:
        return None
    step_dir = layout.resolve(cfg.checkpoint.load)
    manifest = layout.check_resume_config(step_dir, cfg)
    mesh = layout.mesh_change(manifest["config"], cfg)
    if mesh is not None:
        log.warning("resuming %s on another trainer mesh, %s: %s", step_dir, mesh, layout.MESH_CHANGE)
    if resumes_here(cfg):
        pending = manifest.get("pending_eval_step") == manifest["step"]
        layout.trim_metrics(run_dir_of(cfg), manifest["step"], drop_eval_at_step=pending)
    return ResumePoint(step_dir, manifest)


class Checkpointer:
    """Saves `RUN/checkpoints/step_N/` every `checkpoint.interval` steps (at rollout-batch boundaries) and at
    the end, keeping `checkpoint.keep_last`; restores one; exports the final model."""

    def __init__(self, cfg: VerstConfig, run_dir: Path, ranks: TrainerRanks, rollouts: Rollouts,
                 steps_per_rollout: int):
        self.cfg, self.run_dir, self.ranks, self.rollouts = cfg, Path(run_dir), ranks, rollouts
        self.steps_per_rollout = steps_per_rollout
        self.last_step: int | None = None
        self.last_save_s: float | None = None  # the last committed save's seconds, from its start
        self._committing: concurrent.futures.Future | None = None
        self._abandoned = threading.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="verst-checkpoint")
        layout.remove_tmp_dirs(self.run_dir)

    def due(self, version: int) -> bool:
        interval = self.cfg.checkpoint.interval
        return bool(interval) and version % interval == 0 and self.at_boundary(version) and version != self.last_step

    def at_boundary(self, version: int) -> bool:
        """Whether a checkpoint of `version` may be taken: at a rollout-batch boundary (any step, fully async)."""
        return self.cfg.schedule == "fully_async" or version % self.steps_per_rollout == 0

    async def save(self, version: int, history: list[tuple[int, float]], eval_in_flight: bool) -> float:
        """Save the run at `version` with its evaluation `history` (and whether an evaluation of `version`
        is in flight, which a resumed run makes again); returns the pause before the run may go on."""
        await self.wait()
        start = time.perf_counter()
        final = layout.checkpoints_dir(self.run_dir) / layout.step_dir_name(version)
        try:
            tmp = layout.new_tmp_dir(self.run_dir, version)
        except OSError as error:
            raise layout.not_saved(final, final.with_name(layout.TMP_PREFIX + final.name), error) from error
        parts = {"the trainer ranks' save": asyncio.to_thread(self.ranks.apply, save_backend,
                                                              str(tmp / layout.TRAINER_DIR), True),
                 "the rollout manager's save": self.rollouts.save(tmp)}
        # Both parts end before a failure removes the directory: the other would write into it again.
        outcomes = dict(zip(parts, await asyncio.gather(*parts.values(), return_exceptions=True)))
        for what, outcome in outcomes.items():
            if isinstance(outcome, Exception):
                raise layout.not_saved(final, tmp, outcome, what) from outcome
            if isinstance(outcome, BaseException):  # an interrupt stays one
                raise outcome
        rollout_counts = outcomes["the rollout manager's save"]
        manifest = {
            "step": version, "version": version, "schedule": self.cfg.schedule,
            "eval_history": [list(entry) for entry in history],
            "pending_eval_step": version if eval_in_flight else None,
            "rollout": rollout_counts, "config": self.cfg.model_dump(mode="json"),
        }
        if self.rollouts.multi_lora:  # each adapter's steps and scores
            manifest["adapters"] = {lane.adapter: {"steps": lane.steps, "eval_history": [list(e) for e in lane.eval_history]}
                                    for lane in self.rollouts.lanes}
        self._committing = self._pool.submit(self._commit, tmp, manifest, start)
        self.last_step = version
        return time.perf_counter() - start

    def _commit(self, tmp: Path, manifest: dict[str, Any], start: float) -> None:
        """In the background: once the ranks' writes have ended, the atomic commit; `last_save_s` is then
        the whole save's time (pause, writes, commit)."""
        try:
            layout.wait_trainer_writes(tmp / layout.TRAINER_DIR, self.cfg.cluster.trainer_ranks, manifest["step"],
                                       abandoned=self._abandoned)
        except layout.CheckpointError as error:
            if self._abandoned.is_set():  # a dead rank may still hold files there; the next run removes it
                raise
            raise layout.not_saved(self.run_dir / layout.CHECKPOINTS_DIR / layout.step_dir_name(manifest["step"]),
                                   tmp, error) from error
        layout.commit(tmp, manifest, self.cfg.checkpoint.keep_last)
        self.last_save_s = time.perf_counter() - start

    async def restore(self, point: ResumePoint) -> None:
        """The trainer's state on the ranks, the rollout side's, and each lane's steps (multi-LoRA: with each
        adapter's scores), from `point`; the run then takes its version and evaluation history."""
        wait_ready = getattr(self.ranks, "wait_ready", None)
        if wait_ready is not None:
            await asyncio.to_thread(wait_ready)  # the load waits behind the ranks' start-up
        steps = await asyncio.to_thread(self.ranks.apply, load_backend, str(point.step_dir / layout.TRAINER_DIR))
        if steps[0] != point.version:
            raise layout.CheckpointError(f"{point.step_dir}: trainer state is at step {steps[0]}, the manifest says "
                                         f"version {point.version}")
        await self.rollouts.load(point.step_dir)
        self.last_step = point.version
        lanes = self.rollouts.lanes
        if not self.rollouts.multi_lora:
            lanes[0].steps = point.version
        else:
            saved = point.manifest.get("adapters") or {}
            if set(saved) != {lane.adapter for lane in lanes}:
                raise layout.CheckpointError(f"{point.step_dir} holds the adapters {sorted(saved)}; this run trains "
                                             f"{sorted(lane.adapter for lane in lanes)} (lora.adapters)")
            for lane in lanes:
                lane.steps = int(saved[lane.adapter]["steps"])
                lane.eval_history = [(int(step), float(score)) for step, score in saved[lane.adapter]["eval_history"]]
        log.info("resumed from %s at step %d", point.step_dir, point.version)

    async def finish(self, version: int, history: list[tuple[int, float]]) -> float | None:
        """At the end of a run: the final checkpoint (`checkpoint.save`), waited for, and the final policy as a
        Hugging Face checkpoint in `RUN/hf` (`checkpoint.export_hf`; with LoRA the adapter, and the merged
        model in `RUN/hf/merged` with `checkpoint.merge_lora`). Returns the final save's pause, if any."""
        cfg, pause = self.cfg, None
        if cfg.checkpoint.save and self.last_step != version:
            pause = await self.save(version, history, eval_in_flight=False)
        await self.wait()
        if cfg.checkpoint.export_hf:
            hf = self.run_dir / "hf"
            await asyncio.to_thread(self.ranks.apply, export_backend, str(hf), cfg.checkpoint.merge_lora)
            drop_untrained_template(cfg, hf)
        return pause

    async def wait(self) -> None:
        """Wait for the commit in the background, if any (its error is raised here)."""
        committing, self._committing = self._committing, None
        if committing is not None:
            await asyncio.wrap_future(committing)

    def abandon(self) -> None:
        """The run failed: a commit still waiting for the ranks' writes gives up (its temporary directory
        stays until the next run in this directory removes it; `latest` keeps the previous checkpoint)."""
        self._abandoned.set()

    async def settle(self, timeout_s: float = 10.0) -> None:
        """After `abandon`: the commit in flight ends, committed or given up, so `latest` is final when the
        run's error names it. Its own error is logged: the run's error is the one raised."""
        committing, self._committing = self._committing, None
        if committing is None:
            return
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.wrap_future(committing)
        except Exception as error:  # TimeoutError too: a commit stuck on its disk is left to its thread
            log.warning("the checkpoint commit in flight when the run stopped did not end: %s", cause_text(error))

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def drop_untrained_template(cfg: VerstConfig, hf: Path) -> None:
    """Trained on raw prompts: the export's chat template goes, so chat requests to it are refused."""
    if not cfg.data.apply_chat_template:
        drop_chat_template(hf)
        if (hf / MERGED_LORA_DIR).is_dir():
            drop_chat_template(hf / MERGED_LORA_DIR)
