"""An RL run's parts and the named steps the three schedules' loops call: generate, take, train, sync
weights, evaluate, log, finish (`run_start.open_rl_run` starts the parts).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from verst.config import BatchPlan, VerstConfig
from verst.eval.agentic import score_key
from verst.eval.fleet import EvalFleet
from verst.inference_client.fleet import IdleMeter
from verst.monitor import MetricsLogger, write_summary
from verst.monitor.progress import RunProgress
from verst.monitor.report import write_report
from verst.orchestration import EngineMemory, RolloutBatch, RolloutSource, WeightPush
from verst.orchestration.health import EngineSupervisor
from verst.orchestration.watchdog import Watchdog
from verst.schedules import checkpointing
from verst.schedules.checkpointing import RunCheckpointer
from verst.schedules.evaluation import EvaluationSteps
from verst.schedules.lanes import Lane, print_adapter_scores, rollout_ids, turns
from verst.schedules.lanes import summary as lanes_summary
from verst.schedules.train_steps import train_adapter_step, train_rollout_step
from verst.sync.syncer import WeightSyncError
from verst.trainer.backend import TrainerRanks

TAKE_TIMEOUT_S = 30.0  # fully async: log and wait again when no group arrived for this long


# ---- the run --------------------------------------------------------------------------------------
@dataclasses.dataclass
class RLRun(EvaluationSteps):
    """The parts of a running RL job and the named steps over them. `version` is the trainer's
    weight version: the number of optimizer steps taken (the engines serve it after each sync)."""

    cfg: VerstConfig
    plan: BatchPlan
    run_dir: Path
    logger: MetricsLogger
    trainer: TrainerRanks  # FSDP2 rank actors
    engines: EngineMemory
    rollout: RolloutSource  # the rollout manager actor
    syncer: WeightPush  # pushes run in trainer rank 0
    router_url: str  # the router, or the one engine when there is no router (cluster.router)
    idle_meter: IdleMeter
    progress: RunProgress
    version: int = 0
    checkpointer: RunCheckpointer | None = None  # None: this run saves no checkpoint
    resumed_pending_eval: bool = False  # resumed from a checkpoint whose step's evaluation was in flight
    eval_history: list[tuple[int, float]] = dataclasses.field(default_factory=list)
    startup_metrics: dict[str, float] = dataclasses.field(default_factory=dict)  # time/startup/*
    started: float = dataclasses.field(default_factory=time.perf_counter)
    started_at: float = dataclasses.field(default_factory=time.time)  # the same moment, wall clock
    watchdog: Watchdog | None = None  # bounds each phase by its `fault.*_timeout_s` (None: unbounded)
    supervisor: EngineSupervisor | None = None  # restarts failed engines (fault.tolerate_engines)
    trainer_restarts: int = 0  # times this run restarted from a checkpoint after a trainer rank died
    eval_fleet: EvalFleet | None = None  # the evaluation fleet (eval.num_engines), outside the weight sync
    _evaluations: list[asyncio.Task] = dataclasses.field(default_factory=list, init=False, repr=False)
    _evaluating: dict[int, asyncio.Task] = dataclasses.field(default_factory=dict, init=False, repr=False)
    _last_eval_step: int | None = dataclasses.field(default=None, init=False, repr=False)
    lanes: list[Lane] = dataclasses.field(default_factory=list)  # multi-LoRA: one per adapter; else the run's own

    def __post_init__(self) -> None:
        if not self.lanes:
            self.lanes = [Lane(self.cfg, self.plan, self.rollout)]

    @property
    def multi_lora(self) -> bool:
        return self.lanes[0].adapter is not None

    # -- named steps ---------------------------------------------------------------------------
    async def begin(self) -> None:
        """The start of the loop: the step-0 evaluation (with the start-up metrics), or, resumed, the
        evaluation the checkpoint's step had in flight."""
        if self.version == 0:
            await self.start_evaluation(self.startup_metrics)
        elif self.resumed_pending_eval:
            await self.start_evaluation()

    @property
    def first_rollout(self) -> int:
        """The rollout batch the loop starts at (past those of a resumed checkpoint)."""
        return self.version // self.plan.train_steps_per_rollout

    def turns(self) -> Iterator[Lane]:
        """Fully async: the lane of each train step left (multi-LoRA: the adapters in turn)."""
        return turns(self.lanes)

    def rollout_turns(self) -> Iterator[tuple[int, Lane]]:
        """Sync: each rollout batch left, with its lane (multi-LoRA: every adapter's batch k, then k + 1)."""
        return rollout_ids(self.lanes)

    def start_async(self) -> None:
        for lane in self.lanes:
            lane.rollout.start_async()

    def stop_async(self) -> None:
        for lane in self.lanes:
            lane.rollout.stop_async()

    async def checkpoint_if_due(self) -> None:
        """Save a checkpoint every `checkpoint.interval` steps (see `checkpointing`)."""
        if self.checkpointer is not None and self.checkpointer.due(self.version):
            await checkpointing.save_checkpoint(self)

    async def generate(self, rollout_id: int, lane: Lane | None = None) -> tuple[RolloutBatch, dict[str, float]]:
        """One rollout batch (its groups stay on the rollout side until the ranks fetch them) and its metrics."""
        lane = lane or self.lanes[0]
        return await self.guard(f"rollout step {rollout_id}", "rollout_timeout_s",
                                asyncio.to_thread(lane.rollout.generate_train_batch, rollout_id, self.version))

    async def take(self, lane: Lane | None = None) -> tuple[RolloutBatch, dict[str, float]]:
        """Fully async: one train step's groups from the buffer (stale ones are dropped there)."""
        return await self.guard(f"taking the groups of train step {self.version + 1}", "rollout_timeout_s",
                                self._take(lane or self.lanes[0]))

    async def _take(self, lane: Lane) -> tuple[RolloutBatch, dict[str, float]]:
        start, need, have = time.perf_counter(), lane.plan.groups_per_train_step, 0
        while have < need:
            got = await asyncio.to_thread(lane.rollout.take_into_batch, need - have, self.version, TAKE_TIMEOUT_S)
            if not got:
                print(f"[rl] no finished group for {TAKE_TIMEOUT_S:.0f} s (have {have}/{need}); waiting", flush=True)
            have += got
        batch, metrics = await asyncio.to_thread(lane.rollout.taken_batch)
        metrics["perf/trainer_wait_s"] = time.perf_counter() - start
        return batch, metrics

    async def train(self, batch: RolloutBatch, lane: Lane | None = None) -> AsyncIterator[dict[str, float]]:
        """The optimizer steps on one rollout batch, `plan.groups_per_train_step` groups each, yielding each
        step's metrics (the caller pushes weights in between). Each runs in the trainer ranks, which fetch
        the batch at its first step and keep it, with the old policy's logprobs taken before that step when
        it gets more than one (see `train_steps`). Colocated engines free memory meanwhile. Multi-LoRA: the
        steps train `lane`'s adapter, with its run config."""
        lane = lane or self.lanes[0]
        step_fn, args = (train_rollout_step, ()) if lane.adapter is None else (train_adapter_step, (lane.adapter,))
        for first in range(0, batch.num_groups, lane.plan.groups_per_train_step):
            if self.cfg.cluster.placement == "colocated":
                await self.settle_engine_evaluation()  # it needs the engines' memory
                await asyncio.to_thread(self.engines.release_memory)
            try:
                start = time.perf_counter()
                groups = batch.groups if first == 0 else None  # later steps use the ranks' copy
                # Tensors are built, and advantages computed, next to the model.
                metrics = await self.guard(f"train step {self.version + 1}", "step_timeout_s", asyncio.to_thread(
                    on_ranks, self.trainer, step_fn, *args, groups, first, lane.cfg))
                metrics["time/train_s"] = time.perf_counter() - start  # with the trips to the ranks
            finally:
                if self.cfg.cluster.placement == "colocated":
                    await asyncio.to_thread(self.engines.resume_memory)
            if self.version == 0:
                metrics.update(trainer_startup_metrics(self.trainer, self.started_at))
            self.version += 1
            lane.steps += 1
            yield metrics

    async def sync_weights(self, lane: Lane | None = None) -> dict[str, float]:
        """Push the trainer's weights as `version` when the interval says so (pause → push → continue);
        multi-LoRA: `lane`'s adapter, the one its step trained, under its name."""
        if not self.syncer.due(self.version):
            return {}
        await self.settle_engine_evaluation()  # an evaluation in flight scores the weights the engines serve now
        adapter = lane.adapter if lane is not None else None
        return await self.guard(f"weight sync to version {self.version}", "sync_timeout_s", self._sync(adapter))

    async def _sync(self, adapter: str | None = None) -> dict[str, float]:
        named = {"lora_path": adapter} if adapter is not None else {}  # multi-LoRA: the adapter the push carries
        if self.supervisor is None:
            return await self.syncer.sync(self.version, **named)
        for retry in (False, True):  # once more after an engine that failed during the push was restarted
            await self.supervisor.check_now()  # a dead engine is restarted before the push reaches it
            async with self.supervisor.lock:  # no push while an engine is being replaced
                try:
                    metrics = await self.syncer.sync(self.version, **named)
                    await self.supervisor.admit_synced(self.version)  # engines restarted ahead of the others
                    return metrics
                except WeightSyncError as error:
                    if retry or not self.supervisor.restarts_engines:
                        raise
                    print(f"[fault] {str(error)[:300]}; pushing again once failed engines are restarted", flush=True)
        raise AssertionError("unreachable")

    async def guard(self, phase: str, limit_field: str, awaitable: Any) -> Any:
        """`await awaitable` within `fault.<limit_field>`: past it the watchdog dumps every process's stacks
        and stops the run naming `phase`."""
        if self.watchdog is None:
            return await awaitable
        limit = getattr(self.cfg.fault, limit_field)
        return await self.watchdog.guard(phase, limit, f"fault.{limit_field}", awaitable)

    @property
    def score_key(self) -> str:
        return score_key(self.cfg)

    def eval_due(self) -> bool:
        return bool(self.cfg.eval.interval) and self.version % self.cfg.eval.interval == 0

    async def log(self, metrics: dict[str, float], step_start: float, lane: Lane | None = None) -> None:
        """Log one train step's metrics (adding step time and the engines' idle fraction since the
        previous step) and show it on the progress display. An evaluation still in flight on the engines is
        logged first: rows stay in step order (`eval.backend` scores are logged when they arrive)."""
        await (self.settle_engine_evaluation() if self.on_engines else self._harvest())
        if lane is not None and lane.adapter is not None:  # multi-LoRA: the step's metrics are its adapter's
            metrics = {**lane.namespaced(metrics), f"{lane.prefix}train/steps": float(lane.steps)}
        metrics["perf/step_time_s"] = time.perf_counter() - step_start
        metrics["train/weight_version"] = float(self.version)
        idle = await self.guard("reading the engines' busy time (get_server_info)", "engine_call_timeout_s",
                                self.idle_meter.read())
        if idle is not None:
            metrics["perf/engine_idle_fraction"] = idle
        if self.supervisor is not None:
            metrics.update(self.supervisor.metrics())
        if self.trainer_restarts:
            metrics["fault/trainer_restarts"] = float(self.trainer_restarts)
        self.logger.log(metrics, step=self.version)
        self.progress.step(self.version, metrics)

    def finish(self) -> dict[str, Any]:
        """summary.json (accuracy before/after with the versions measured) and the HTML report."""
        # an evaluation may have been skipped (eval.on_error = "skip"): no score then
        (v0, before), (v1, after) = (self.eval_history[0], self.eval_history[-1]) if self.eval_history else \
            ((None, None), (None, None))
        summary = {
            f"{self.score_key}_before": before, f"{self.score_key}_after": after,
            "eval/version_before": v0, "eval/version_after": v1,
            "train/steps": self.version, "time/total_s": time.perf_counter() - self.started,
            "schedule": self.cfg.schedule, "sync/transport": self.cfg.sync.transport,
            **lanes_summary(self.lanes, self.score_key),
        }
        write_summary(self.run_dir, summary)
        report = write_report(self.run_dir)
        scores = "no evaluation" if before is None else \
            f"held-out greedy {self.score_key[5:]} {before:.1%} (version {v0}) -> {after:.1%} (version {v1})"
        if self.multi_lora:  # the scores are the adapters'
            scores = print_adapter_scores(self.lanes, summary, self.score_key, self.cfg.schedule)
        print(f"[{self.cfg.schedule}] {scores} in {summary['time/total_s']:.0f} s; report {report}", flush=True)
        return summary


def on_ranks(trainer: TrainerRanks, step: Callable[..., Any], *args: Any) -> Any:
    """`step(backend, *args)` next to the model, on every rank (a collective step); rank 0's result."""
    return trainer.apply(step, *args)[0]


def trainer_startup_metrics(trainer: TrainerRanks, started_at: float) -> dict[str, float]:
    """`time/startup/trainer_s`: from the run's start (wall clock) until the last trainer rank had built its
    backend; nothing for a backend without rank infos (in this process)."""
    infos = trainer.infos
    if not infos:
        return {}
    return {"time/startup/trainer_s": max(info["ready_at"] for info in infos) - started_at}
