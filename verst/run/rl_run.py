"""An RL run: its parts, and the named steps the three schedules' loops call over them: begin, generate,
take, train, end the step (push weights, log, evaluate, save when due) and finish. `start.open_rl_run`
builds the parts; each part has a narrow constructor and knows nothing of the run.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from verst.config import BatchPlan, VerstConfig
from verst.orchestration import TrainBatchRef
from verst.run.checkpointer import Checkpointer, ResumePoint
from verst.run.evaluator import Evaluator
from verst.run.lanes import Lane
from verst.run.monitor import RunMonitor
from verst.run.rollouts import Rollouts
from verst.run.signals import STOP, STOP_GRACE_S, StoppedBySignal
from verst.run.training import TrainerGroup
from verst.run.weights import WeightPush


@dataclasses.dataclass
class TrainerVersion:
    """The trainer's weight version: the number of optimizer steps taken (the engines serve it after each
    push). Shared by the run and the parts that read it."""

    value: int = 0
    watchers: list[Callable[[int], None]] = dataclasses.field(default_factory=list)

    def get(self) -> int:
        return self.value

    def advance(self) -> None:
        """One optimizer step taken: each watcher sees the new version before the run awaits anything."""
        self.value += 1
        for watch in self.watchers:
            watch(self.value)


class RLRun:
    """The composition root of an RL run. `version` is the trainer's weight version."""

    def __init__(self, cfg: VerstConfig, plan: BatchPlan, *, rollouts: Rollouts, trainer: TrainerGroup,
                 weights: WeightPush, evaluator: Evaluator, checkpointer: Checkpointer, monitor: RunMonitor,
                 version: TrainerVersion, startup_metrics: dict[str, float] | None = None):
        self.cfg, self.plan = cfg, plan
        self.rollouts, self.trainer, self.weights = rollouts, trainer, weights
        self.evaluator, self.checkpointer, self.monitor = evaluator, checkpointer, monitor
        self._version = version
        self.startup_metrics = dict(startup_metrics or {})  # time/startup/*, logged with the step-0 evaluation
        self.resumed_pending_eval = False  # resumed from a checkpoint whose step's evaluation was in flight

    @property
    def version(self) -> int:
        return self._version.value

    def watch_version(self, watcher: Callable[[int], None]) -> None:
        """`watcher(version)` runs at each optimizer step, inside the step, before its push or anything it
        starts (a measurement window's edges, for instance)."""
        self._version.watchers.append(watcher)

    @property
    def lanes(self) -> list[Lane]:
        return self.rollouts.lanes

    @property
    def first_rollout(self) -> int:
        """The rollout batch the loop starts at (past those of a resumed checkpoint)."""
        return self.version // self.plan.train_steps_per_rollout

    def rollout_turns(self) -> Iterator[tuple[int, Lane]]:
        """Sync: each rollout batch left, with its lane (multi-LoRA: every adapter's batch k, then k + 1)."""
        return self.rollouts.rollout_turns()

    def turns(self) -> Iterator[Lane]:
        """Fully async: the lane of each train step left (multi-LoRA: the adapters in turn)."""
        return self.rollouts.turns()

    # ---- start-up ---------------------------------------------------------------------------------
    async def resume(self, point: ResumePoint) -> None:
        """Continue from a checkpoint: the trainer, the rollout side, the evaluation history and version, and
        the engines get its weights as its version before any rollout."""
        await self.checkpointer.restore(point)
        self._version.value = point.version
        self.evaluator.history = [(int(step), float(score)) for step, score in point.manifest["eval_history"]]
        self.resumed_pending_eval = point.manifest.get("pending_eval_step") == point.version
        await self.push_all()

    async def push_all(self) -> None:
        """The engines get every trained policy's weights as the current version (start-up and resume)."""
        if self.rollouts.multi_lora:  # every adapter, under its name
            await self.weights.push_adapters(self.version, self.lanes)
        elif self.version or self.cfg.lora.served_adapter:  # every request names the adapter: push step 0's
            await self.weights.push_first(self.version)

    # ---- the loop's steps -------------------------------------------------------------------------
    async def begin(self) -> None:
        """The start of the loop: the step-0 evaluation (with the start-up metrics), or, resumed, the
        evaluation the checkpoint's step had in flight. From here a signal stops the run at a step's end."""
        self.monitor.begin(self.version)
        STOP.stop_at_steps(self.cfg.checkpoint.on_signal)
        if self.version == 0:
            await self.evaluator.start(0, self.startup_metrics)
        elif self.resumed_pending_eval:
            await self.evaluator.start(self.version)

    async def generate(self, rollout_id: int, lane: Lane | None = None) -> tuple[TrainBatchRef, dict[str, float]]:
        """One rollout batch (its groups stay on the rollout side until the ranks fetch them) and its metrics."""
        return await self.rollouts.generate(rollout_id, lane or self.lanes[0], self.version)

    def generating(self) -> contextlib.AbstractAsyncContextManager[None]:
        """Fully async: the background workers generate inside the block."""
        return self.rollouts.generating()

    async def take(self, lane: Lane | None = None) -> tuple[TrainBatchRef, dict[str, float]]:
        """Fully async: one train step's groups from the buffer (stale ones are dropped there)."""
        return await self.rollouts.take(lane or self.lanes[0], self.version)

    async def train(self, batch: TrainBatchRef, lane: Lane | None = None) -> AsyncIterator[dict[str, float]]:
        """The optimizer steps on one rollout batch, yielding each step's metrics (see `TrainerGroup.train`)."""
        lane = lane or self.lanes[0]
        async for metrics in self.trainer.train(batch, lane, self.version):
            self._version.advance()
            lane.steps += 1
            yield metrics

    async def end_step(self, metrics: dict[str, float], step_start: float, lane: Lane | None = None) -> None:
        """The tail every loop shares after an optimizer step: push the weights when due, log the step (with
        the push's metrics), start an evaluation when due (it overlaps the next step), save when due."""
        metrics = {**metrics, **await self.sync_weights(lane)}
        await self.evaluator.before_log()  # rows stay in step order
        await self.monitor.log_step(metrics, step_start, self.version, lane)
        if self.evaluator.due(self.version):
            await self.evaluator.start(self.version)
        if self.checkpointer.due(self.version):
            await self.save_checkpoint()
        if STOP.requested and self.checkpointer.at_boundary(self.version):
            await self.stop_on_signal()

    async def sync_weights(self, lane: Lane | None = None) -> dict[str, float]:
        """Push the trainer's weights as `version` when `sync.interval` says so; an evaluation in flight on the
        engines scores the weights they serve now, so it ends first."""
        if not self.weights.due(self.version):
            return {}
        await self.evaluator.settle_on_engines()
        return await self.weights.push(self.version, lane)

    async def stop_on_signal(self) -> None:
        """A signal asked the run to stop (`checkpoint.on_signal`): save a checkpoint of this step unless one
        is saved or the last save's time does not fit in the grace left, wait for its commit, and stop."""
        signum, left, expected = STOP.signum, STOP.seconds_left(), self.checkpointer.last_save_s
        if self.checkpointer.last_step == self.version:
            saved = f"checkpoint of step {self.version} saved"
        elif expected is not None and expected > left:
            saved = (f"no checkpoint of step {self.version}: the last save took {expected:.1f} s, {left:.1f} s of "
                     f"the {STOP_GRACE_S:g} s after {signum.name} were left")
        else:
            await self.save_checkpoint()
            saved = f"checkpoint of step {self.version} saved"
        await self.checkpointer.wait()
        raise StoppedBySignal(signum, saved)

    async def save_checkpoint(self) -> None:
        pause = await self.checkpointer.save(self.version, self.evaluator.history, self.evaluator.in_flight())
        self.monitor.log({"time/checkpoint_s": pause}, step=self.version)

    async def finish(self) -> dict[str, Any]:
        """The end of the loop: the last version's evaluation, the final checkpoint and export, summary.json
        and the report; returns the summary."""
        await self.evaluator.finish(self.version)
        pause = await self.checkpointer.finish(self.version, self.evaluator.history)
        if pause is not None:
            self.monitor.log({"time/checkpoint_s": pause}, step=self.version)
        return self.monitor.finish(self.version, self.evaluator.history, self.lanes, self.evaluator.score_key)

    async def stop(self) -> None:
        """However the run ends: evaluations in flight are cancelled, the checkpoint pool and the weight push
        closed."""
        await self.evaluator.drop()
        self.checkpointer.close()
        await self.weights.close()
