"""What the three RL schedules share: starting a run (Ray placement, engines, trainer ranks, the
rollout manager with its router, the weight syncer) and the named steps the loops call —
generate, take, train, sync weights, evaluate, log, finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from verst.config import BatchPlan, VerstConfig, batch_plan
from verst.config.adapters import adapter_names, adapter_run_config
from verst.engines.kinds import engine_kind, resolve_engine_python
from verst.eval.agentic import score_key
from verst.eval.fleet import EvalFleet, open_eval_fleet
from verst.inference_client.client import Timeouts
from verst.inference_client.fleet import EngineFleet, IdleMeter
from verst.models.loader import check_same_tokenizer
from verst.monitor import MetricsLogger, prepare_run_dir, write_summary
from verst.monitor.progress import RunProgress
from verst.monitor.report import write_report
from verst.orchestration import EngineMemory, Orchestration, RolloutBatch, RolloutSource, RouterSpec, WeightPush
from verst.orchestration.health import EngineSupervisor, restart_weights
from verst.orchestration.watchdog import RunFailure, RunProcesses, Watchdog, failure_report
from verst.orchestration.weight_sync import TrainerWeightSync
from verst.schedules import checkpointing
from verst.schedules.checkpointing import RunCheckpointer
from verst.schedules.evaluation import EvaluationSteps, _tokenizer
from verst.schedules.lanes import Lane, print_adapter_scores, push_adapters, rollout_ids, turns
from verst.schedules.lanes import summary as lanes_summary
from verst.schedules.rollout_side import build_rollout_parts, prepare_rollout_parts
from verst.schedules.train_steps import train_adapter_step, train_rollout_step
from verst.sync.syncer import WeightSyncError
from verst.trainer.backend import TrainerRanks, fsdp2_backend

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


def engine_args(cfg: VerstConfig, device: str | None) -> list[str]:
    """The policy engines' command line for a run: `cluster.engine`'s server arguments (`engine_server_args`)
    and the modes of `algorithm` the engines carry out (true on-policy scoring, routed experts on every reply)."""
    args = engine_server_args(cfg)
    if cfg.algorithm.true_on_policy:
        if device == "cuda":
            raise ValueError("algorithm.true_on_policy = true holds on the CPU only (float32 CPU kernels on both "
                             "sides); cluster.device = 'auto' chose cuda here: set cluster.device = 'cpu'")
        args.append("--true-on-policy")
    if cfg.algorithm.routing_replay != "off":
        args.append("--return-routed-experts")
    return args


@contextlib.asynccontextmanager
async def open_rl_run(cfg: VerstConfig, restarts: int = 0) -> AsyncIterator[RLRun]:
    """Start every part of an RL run; stop all on exit. The engines, the rollout manager's process and the
    trainer ranks start at the same time, and the run begins (first rollouts, step-0 evaluation) once the
    engines serve: the trainer, usually the slowest to start, is first needed by the first train step.
    `restarts`: the times this run has restarted after a trainer rank died (`fault/trainer_restarts`)."""
    started, started_at = time.perf_counter(), time.time()  # the summary's time/total_s includes start-up
    cfg = absolute_paths(cfg)
    resume = checkpointing.prepare_resume(cfg)  # refused before anything starts
    if cfg.teacher.model_path is not None:
        check_same_tokenizer(cfg.model.path, cfg.teacher.model_path)
    _load_in_background(_tokenizer, cfg.model.path)  # the evaluations' (transformers' import), while Ray starts
    run_dir = prepare_run_dir(cfg)
    (run_dir / "logs").mkdir(exist_ok=True)
    plan = batch_plan(cfg)
    lane_cfgs = {name: absolute_paths(adapter_run_config(cfg, name)) for name in adapter_names(cfg)}  # multi-LoRA
    adapter_steps = {name: batch_plan(own).total_train_steps for name, own in lane_cfgs.items()}
    temperature = cfg.rollout.sampling.temperature or 1.0  # greedy rollouts: logprobs of the raw distribution
    logger = MetricsLogger.for_run(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                                   wandb_project=cfg.logging.wandb_project, name=cfg.name)
    clock = StartupClock(started)
    teachers = cfg.teacher.num_engines if cfg.teacher.model_path is not None else 0
    with logger, Orchestration(cfg.cluster, schedule=cfg.schedule, log_dir=run_dir / "logs",
                               teacher_engines=teachers, eval_engines=cfg.eval.num_engines) as orch:
        clock.lap("ray")
        orch.check_transport(cfg.sync.transport)
        # The trainer ranks, the slowest to start, are created first: they get the worker processes Ray has
        # already started. The factory imports the backend (and torch) in the ranks only.
        trainer = orch.start_trainer(functools.partial(
            fsdp2_backend, cfg.model, cfg.trainer, total_steps=plan.total_train_steps,
            temperature=temperature, device=orch.device,
            ref_model_path=cfg.model.path if cfg.algorithm.needs_reference else None, lora=cfg.lora,
            critic=cfg.critic if cfg.algorithm.needs_critic else None,
            per_sequence=cfg.algorithm.true_on_policy, routing=cfg.algorithm.routing_replay,
            adapter_steps=adapter_steps or None,
        ), wait=False)  # its start-up is logged with the first train step (time/startup/trainer_s)
        engines = orch.start_engines(cfg.model.path, args=engine_args(cfg, orch.device), wait=False)
        teacher = orch.start_teacher_engines(cfg.teacher.model_path, args=engine_server_args(cfg),
                                             wait=False) if teachers else None
        evaluators = orch.start_eval_engines(cfg.model.path, args=engine_server_args(cfg),
                                             wait=False) if cfg.eval.num_engines else None
        # one rollout manager per policy trained (multi-LoRA: per adapter, each with its data, reward, buffer)
        rollouts = {name: orch.start_rollout_manager(None, functools.partial(build_rollout_parts, own),
                                                     router=router_spec(own, cfg.cluster.num_engines),
                                                     prepare=functools.partial(prepare_rollout_parts, own))
                    for name, own in (lane_cfgs or {None: cfg}).items()}
        rollout = next(iter(rollouts.values()))
        urls = engines.wait_ready().urls
        teacher_urls = teacher.wait_ready().urls if teacher is not None else []
        if evaluators is not None:
            evaluators.wait_ready()
        clock.lap("engines")
        for manager in rollouts.values():
            manager.start(urls, teacher_urls)
        clock.lap("rollout_manager")  # router, data source and rollout fn, once the engines are up
        lanes = [Lane(own, batch_plan(own), rollouts[name], adapter=name) for name, own in lane_cfgs.items()]
        total_steps = sum(adapter_steps.values()) or plan.total_train_steps
        progress = RunProgress(cfg.schedule, total_steps, mode="auto" if cfg.logging.progress else "off")
        processes = RunProcesses(run_dir, engines, trainer, list(rollouts.values()), run_dir / "logs", node=orch.node)
        async with EngineFleet(urls, timeouts=Timeouts(control=cfg.fault.engine_call_timeout_s)) as fleet, \
                open_eval_fleet(cfg, evaluators, run_dir / "logs", eval_router(cfg)) as eval_fleet:
            syncer = TrainerWeightSync(trainer, cfg.sync, urls, checker=weight_checker(cfg, trainer, temperature),
                                       fleet=fleet, device=orch.device, snapshot_dir=str(run_dir / "weights"),
                                       source_model=cfg.model.path, control_timeout_s=cfg.fault.engine_call_timeout_s)
            watchdog = Watchdog(run_dir, processes)
            supervisor = EngineSupervisor(cfg.fault, engines, list(rollouts.values()), urls, processes, watchdog,
                                          functools.partial(restart_weights, cfg, syncer, trainer, run_dir),
                                          served_version=lambda: syncer.version or 0,
                                          on_restart=syncer.engine_replaced)
            run = RLRun(cfg, plan, run_dir, logger, trainer, engines, rollout, syncer, rollout.router_url or urls[0],
                        IdleMeter(fleet), progress, started=started, started_at=started_at,
                        checkpointer=RunCheckpointer(cfg, run_dir, 1 if lanes else plan.train_steps_per_rollout),
                        watchdog=watchdog, supervisor=supervisor, trainer_restarts=restarts, lanes=lanes,
                        eval_fleet=eval_fleet)
            if resume is not None:
                await checkpointing.restore(run, resume)  # before any rollout: the engines serve its weights
            elif run.multi_lora:  # every adapter's step-0 weights, under its name, before any rollout
                await push_adapters(run, 0)
            elif cfg.lora.served_adapter:  # every request names the adapter: the engines load the step-0 one
                await syncer.sync(0, first=True)
            await run.idle_meter.read()  # the baseline of the first step's idle fraction
            clock.lap("syncer")
            run.startup_metrics = clock.metrics()  # logged with the step-0 evaluation
            print(f"[{cfg.schedule}] started in {clock.summary()}", flush=True)
            try:
                async with supervisor:
                    with progress:
                        yield run
                    await checkpointing.finish(run)  # final checkpoint and Hugging Face export
            except Exception as error:
                run.checkpointer.abandon()  # a commit waiting for a dead rank's write must not hold the exit
                await run.drop_evaluation()
                await syncer.close_within(10.0)  # a dead or stuck part must not hold the report back
                report = None if isinstance(error, RunFailure) else \
                    await asyncio.to_thread(failure_report, processes, error)
                if report is not None:
                    raise report from None  # one screen: what died, how, and its log
                raise
            finally:
                await run.drop_evaluation()  # a run stopped early (an error, cancelled) has one in flight
                run.checkpointer.close()
                await syncer.close()


# ---- helpers ---------------------------------------------------------------------------------------
def engine_server_args(cfg: VerstConfig, version: int = 0) -> list[str]:
    """The engine server's arguments for `cluster.engine`: verst's settings and the pass-through flags."""
    kind = engine_kind(cfg.cluster.engine)
    flags = {"vllm": cfg.vllm, "sglang": cfg.sglang}.get(kind.name, {})
    return kind.server_args(version=version, model_impl=cfg.model.impl, dtype=cfg.model.dtype, flags=flags,
                            engine_python=resolve_engine_python(kind.name, cfg.cluster.engine_python))


class StartupClock:
    """Seconds spent in each start-up phase of a run, since `started` (perf_counter), as `time/startup/`
    metrics: the first thing to look at when a short run is slow."""

    def __init__(self, started: float):
        self.started = self._last = started
        self.phases: dict[str, float] = {}

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.phases[phase] = now - self._last
        self._last = now

    def metrics(self) -> dict[str, float]:
        out = {f"time/startup/{phase}_s": seconds for phase, seconds in self.phases.items()}
        out["time/startup_s"] = self._last - self.started
        return out

    def summary(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in self.phases.items())
        return f"{self._last - self.started:.1f} s ({parts})"


def absolute_paths(cfg: VerstConfig) -> VerstConfig:
    """The config with every file path made absolute: Ray actors do not share the driver's directory."""

    def absolute(path: str | None) -> str | None:
        return str(Path(path).resolve()) if path else path

    run_dir = absolute(cfg.run_dir or str(Path("runs") / cfg.name))
    return cfg.model_copy(update={
        "run_dir": run_dir,
        "model": cfg.model.model_copy(update={"path": absolute(cfg.model.path)}),
        "teacher": cfg.teacher.model_copy(update={"model_path": absolute(cfg.teacher.model_path)}),
        "critic": cfg.critic.model_copy(update={"model_path": absolute(cfg.critic.model_path)}),
        "data": cfg.data.model_copy(update={"train_path": absolute(cfg.data.train_path),
                                            "test_path": absolute(cfg.data.test_path)}),
        "eval": cfg.eval.model_copy(update={"path": absolute(cfg.eval.path)}),
        "rollout": cfg.rollout.model_copy(update={"dump_dir": absolute(cfg.rollout.dump_dir)}),
    })


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


def weight_checker(cfg: VerstConfig, trainer: Any, temperature: float) -> Any:
    """`sync.check_weights`: the check of the first sync against the trainer's logprobs (imports torch)."""
    if not cfg.sync.check_weights:
        return None
    from verst.sync.check import LogprobChecker

    return LogprobChecker(trainer.logprobs, temperature=temperature, lora_path=cfg.lora.served_adapter)


def router_spec(cfg: VerstConfig, num_engines: int) -> RouterSpec | None:
    """The router in front of the engines: manual + min_load affinity for agent sessions, round robin for
    single-turn work; none for a single engine unless `cluster.router = 'always'`."""
    if cfg.cluster.router == "auto" and num_engines == 1:
        return None
    if cfg.rollout.agent_fn is not None:
        return RouterSpec()
    return RouterSpec(policy="round_robin", assignment_mode="min_load")


def eval_router(cfg: VerstConfig) -> tuple[str, str] | None:
    """The evaluation fleet's router (policy, assignment mode), chosen as the rollout engines' is."""
    spec = router_spec(cfg, cfg.eval.num_engines)
    return None if spec is None else (spec.policy, spec.assignment_mode)


def _load_in_background(load: Any, *args: Any) -> None:
    """Warm a cached `load(*args)` in a daemon thread; a failure is left to the caller's own call."""

    def run() -> None:
        with contextlib.suppress(Exception):
            load(*args)

    threading.Thread(target=run, name="verst-preload", daemon=True).start()
