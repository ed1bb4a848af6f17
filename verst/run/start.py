"""Starting an RL run (`open_rl_run`): Ray placement, the engines (policy, teacher, evaluation fleet), the
trainer ranks and one rollout manager per trained policy, all started at once; then the run's parts built
over them, and everything stopped on exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from verst.config import BatchPlan, VerstConfig, batch_plan
from verst.config.adapters import adapter_names, adapter_run_config
from verst.config.registries import ENGINE_KINDS
from verst.eval.fleet import EvalFleet, open_eval_fleet
from verst.eval.local import run_tokenizer
from verst.inference_client.client import Timeouts
from verst.inference_client.fleet import EngineFleet, IdleMeter
from verst.models.loader import check_same_tokenizer
from verst.monitor import MetricsLogger, prepare_run_dir
from verst.monitor.heap import settle_heap
from verst.monitor.progress import RunProgress
from verst.orchestration import EngineActorGroup, Orchestration, RolloutManagerHandle, TrainerActorGroup
from verst.orchestration.health import EngineSupervisor
from verst.orchestration.watchdog import RunProcesses, Watchdog, failure_report
from verst.orchestration.weight_sync import TrainerWeightSync
from verst.rollout.from_config import build_rollout_parts, prepare_rollout_parts
from verst.run.checkpointer import Checkpointer, prepare_resume
from verst.run.cores import CoreBudget, CorePlan, core_layout
from verst.run.ending import end_early
from verst.run.evaluator import Evaluator
from verst.run.guard import Guard
from verst.run.lanes import Lane
from verst.run.monitor import RunMonitor
from verst.run.rl_run import RLRun, TrainerVersion
from verst.run.rollouts import Rollouts
from verst.run.setup import (
    StartupClock,
    absolute_paths,
    engine_args,
    engine_server_args,
    eval_router,
    logged_router_spec,
    weight_checker,
)
from verst.run.signals import STOP
from verst.run.snapshots import EvalSnapshots
from verst.run.training import DeviceShare, TrainerGroup
from verst.run.weights import RestartSource, WeightPush
from verst.trainer.factory import diffusion_backend, fsdp2_backend

log = logging.getLogger(__name__)
RunOpener = Callable[[VerstConfig, int], AbstractAsyncContextManager[RLRun]]
"""`open_run(cfg, restarts)`: what starts a run for a schedule's loop (`open_rl_run`; `verst sim`'s simulated one)."""


@dataclasses.dataclass
class Actors:
    """The processes of a run, started together: trainer ranks, engines and rollout managers (one per
    trained policy: multi-LoRA, per adapter, each with its data, reward and buffer)."""

    trainer: TrainerActorGroup
    engines: EngineActorGroup
    teacher: EngineActorGroup | None
    evaluators: EngineActorGroup | None
    managers: dict[str | None, RolloutManagerHandle]
    lane_cfgs: dict[str | None, VerstConfig]


@contextlib.asynccontextmanager
async def open_rl_run(cfg: VerstConfig, restarts: int = 0) -> AsyncIterator[RLRun]:
    """Start every part of an RL run; stop all on exit. The engines, the rollout managers' processes and the
    trainer ranks start at the same time, and the run begins (first rollouts, step-0 evaluation) once the
    engines serve: the trainer, usually the slowest to start, is first needed by the first train step.
    `restarts`: the times this run has restarted after a trainer rank died (`fault/trainer_restarts`)."""
    started, started_at = time.perf_counter(), time.time()  # the summary's time/total_s includes start-up
    STOP.attach()  # a signal cancels the run until its loop runs (see `RLRun.begin`)
    cfg = absolute_paths(cfg)
    resume = prepare_resume(cfg)  # refused before anything starts
    if cfg.teacher.model_path is not None:
        check_same_tokenizer(cfg.model.path, cfg.teacher.model_path)
    if cfg.model.kind == "causal_lm":  # the evaluations' (transformers' import), while Ray starts
        _load_in_background(run_tokenizer, cfg.model.path)
    run_dir = prepare_run_dir(cfg)
    (run_dir / "logs").mkdir(exist_ok=True)
    plan, clock = batch_plan(cfg), StartupClock(started)
    logger = MetricsLogger.for_run(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                                   wandb_project=cfg.logging.wandb_project, name=cfg.name)
    teachers = cfg.teacher.num_engines if cfg.teacher.model_path is not None else 0
    with logger, Orchestration(cfg.cluster, schedule=cfg.schedule, log_dir=run_dir / "logs", teacher_engines=teachers,
                               eval_engines=cfg.eval.num_engines, plugins=cfg.plugins) as orch:
        clock.lap("ray")
        _watched_by_reaper(orch, run_dir)
        orch.check_transport(cfg.sync.transport)
        layout = core_layout(cfg, orch.device)
        actors = start_actors(orch, cfg, plan, None if layout is None else layout.plan())
        urls = actors.engines.wait_ready().urls
        teacher_urls = actors.teacher.wait_ready().urls if actors.teacher is not None else []
        if actors.evaluators is not None:
            actors.evaluators.wait_ready()
        clock.lap("engines")
        for manager in actors.managers.values():
            manager.start(urls, teacher_urls)
        clock.lap("rollout_manager")  # router, data source and rollout fn, once the engines are up
        processes = RunProcesses(run_dir, actors.engines, actors.trainer, list(actors.managers.values()),
                                 run_dir / "logs", node=orch.node)
        async with EngineFleet(urls, timeouts=Timeouts(control=cfg.fault.engine_call_timeout_s)) as fleet, \
                open_eval_fleet(cfg, actors.evaluators, run_dir / "logs", eval_router(cfg)) as eval_fleet:
            cores = None if layout is None else CoreBudget(layout, actors.trainer, fleet if layout.engines else None)
            if cores is not None:
                log.info("cores: %s", cores.plan.describe())
            syncer = TrainerWeightSync(
                actors.trainer, cfg.sync, urls, fleet=fleet, device=orch.device, snapshot_dir=str(run_dir / "weights"),
                checker=weight_checker(cfg, actors.trainer, sampling_temperature(cfg)),
                source_model=cfg.model.path, control_timeout_s=cfg.fault.engine_call_timeout_s)
            watchdog = Watchdog(run_dir, processes)
            supervisor = EngineSupervisor(
                cfg.fault, actors.engines, list(actors.managers.values()), urls, processes, watchdog,
                RestartSource(cfg, syncer, actors.trainer, run_dir / "weights"),
                served_version=lambda: syncer.version or 0, on_restart=functools.partial(
                    engine_replaced, syncer, cores))
            run = assemble(cfg, plan, run_dir, actors, syncer, supervisor, watchdog, eval_fleet, logger,
                           idle_meter=IdleMeter(fleet), router_url=urls[0], restarts=restarts, started=started,
                           started_at=started_at, cores=cores)
            try:
                if resume is not None:
                    await run.resume(resume)  # before any rollout: the engines serve its weights
                else:
                    await run.push_all()  # LoRA: every adapter's step-0 weights, under its name
                await run.monitor.engine_idle()  # the baseline of the first step's idle fraction
                clock.lap("syncer")
                run.startup_metrics = clock.metrics()  # logged with the step-0 evaluation
                log.info("started in %s", clock.summary())
                settle_heap()  # in the `verst` command's process (`verst.monitor.heap`)
                async with supervisor:
                    with run.monitor.progress:
                        yield run
            except BaseException as error:  # a failure, or an interrupt (a signal, a cancel)
                if isinstance(error, GeneratorExit):
                    raise
                stopped = await end_early(run, error, functools.partial(asyncio.to_thread, failure_report,
                                                                        processes))
                if stopped is error:
                    raise
                raise stopped from None  # one screen: what failed, how, its log, and what to do
            finally:
                await run.stop()  # a run stopped early (an error, cancelled) has an evaluation in flight
                STOP.detach()
                _watched_by_reaper(orch, None)  # its summary is written: a kill from here leaves it as it is


def start_actors(orch: Orchestration, cfg: VerstConfig, plan: BatchPlan, cores: CorePlan | None = None) -> Actors:
    """Every process of the run, started without waiting. The trainer ranks, the slowest to start, come first:
    they get the worker processes Ray has already started. The backend factory imports torch in the ranks.
    `cores`: on CPU, the cores and threads of each rank and policy engine."""
    lane_cfgs = {name: absolute_paths(adapter_run_config(cfg, name)) for name in adapter_names(cfg)}  # multi-LoRA
    adapter_steps = {name: batch_plan(own).total_train_steps for name, own in lane_cfgs.items()}
    trainer = orch.start_trainer(backend_factory(cfg, plan, orch.device, adapter_steps or None),
                                 wait=False, shares=list(cores.trainer) if cores else None)  # time/startup/trainer_s
    engines = orch.start_engines(cfg.model.path, args=engine_args(cfg, orch.device), wait=False,
                                 shares=list(cores.engines) if cores and cores.engines else None)
    teacher = orch.start_teacher_engines(cfg.teacher.model_path, args=engine_server_args(cfg), wait=False) \
        if orch.teacher_engines else None
    evaluators = orch.start_eval_engines(cfg.model.path, args=engine_server_args(cfg), wait=False) \
        if cfg.eval.num_engines else None
    managers = {name: orch.start_rollout_manager(None, functools.partial(build_rollout_parts, own),
                                                 router=logged_router_spec(own, cfg, name),
                                                 prepare=functools.partial(prepare_rollout_parts, own))
                for name, own in (lane_cfgs or {None: cfg}).items()}
    return Actors(trainer, engines, teacher, evaluators, managers, lane_cfgs)


def backend_factory(cfg: VerstConfig, plan: BatchPlan, device: str,
                    adapter_steps: dict[str, int | None] | None) -> Callable[[], Any]:
    """What the trainer ranks build (torch imported there): FSDP2 over the language model, or over the denoiser
    (`model.kind = "diffusion"`)."""
    reference = cfg.model.path if cfg.algorithm.needs_reference else None
    if cfg.model.kind == "diffusion":
        return functools.partial(diffusion_backend, cfg.model, cfg.trainer, cfg.diffusion,
                                 total_steps=plan.total_train_steps, ref_model_path=reference, device=device,
                                 plugins=cfg.plugins)
    return functools.partial(
        fsdp2_backend, cfg.model, cfg.trainer, total_steps=plan.total_train_steps,
        temperature=sampling_temperature(cfg), device=device, ref_model_path=reference, lora=cfg.lora,
        critic=cfg.critic if cfg.algorithm.needs_critic else None,
        per_sequence=cfg.algorithm.true_on_policy, routing=cfg.algorithm.routing_replay,
        adapter_steps=adapter_steps, plugins=cfg.plugins,
    )


def assemble(cfg: VerstConfig, plan: BatchPlan, run_dir: Path, actors: Actors, syncer: TrainerWeightSync,
             supervisor: EngineSupervisor | None, watchdog: Watchdog | None, eval_fleet: EvalFleet | None,
             logger: MetricsLogger, *, idle_meter: IdleMeter | None, router_url: str, restarts: int, started: float,
             started_at: float, cores: CoreBudget | None = None) -> RLRun:
    """The run's parts over its started processes, each given only what it uses."""
    guard, version = Guard(cfg.fault, watchdog), TrainerVersion()
    first = next(iter(actors.managers.values()))
    lanes = [Lane(own, batch_plan(own), actors.managers[name], adapter=name)
             for name, own in actors.lane_cfgs.items()] or [Lane(cfg, plan, first)]
    rollouts = Rollouts(lanes, first.router_url or router_url, guard)
    weights = WeightPush(syncer, guard, transport=cfg.sync.transport, weights_dir=run_dir / "weights",
                         ranks=actors.trainer, supervisor=supervisor)
    total_steps = sum(lane.plan.total_train_steps for lane in lanes)
    progress = RunProgress(cfg.schedule, total_steps, mode="auto" if cfg.logging.progress else "off")
    monitor = RunMonitor(cfg, run_dir, logger, progress, guard, idle_meter=idle_meter, restarts=restarts,
                         started=started, started_at=started_at, cores=cores,
                         **({"fault_metrics": supervisor.metrics} if supervisor is not None else {}))
    snapshots = EvalSnapshots(run_dir, actors.trainer, guard, lora=cfg.lora.enabled,
                              pushed=functools.partial(weights.model_snapshot, lora=cfg.lora.enabled))
    evaluator = Evaluator(cfg, lanes, rollouts.router_url, served_version=lambda: weights.version,
                          trainer_version=version.get, record=monitor.log_evaluation, snapshots=snapshots,
                          fleet=eval_fleet)
    takes_engine_cores = cores is not None and bool(cores.plan.engines) and not cores.plan.concurrent
    trainer = TrainerGroup(actors.trainer, guard, DeviceShare(shared_engines(cfg, actors.engines),
                                                              evaluator.settle_on_engines, supervisor,
                                                              takes_engine_cores), started_at)
    checkpointer = Checkpointer(cfg, run_dir, actors.trainer, rollouts,
                                1 if actors.lane_cfgs else plan.train_steps_per_rollout)
    return RLRun(cfg, plan, rollouts=rollouts, trainer=trainer, weights=weights, evaluator=evaluator,
                 checkpointer=checkpointer, monitor=monitor, version=version)


def engine_replaced(syncer: TrainerWeightSync, cores: CoreBudget | None) -> None:
    """An engine was restarted: the next push reconnects to it, and the next step's end gives it its cores."""
    syncer.engine_replaced()
    if cores is not None:
        cores.engine_replaced()


def shared_engines(cfg: VerstConfig, engines: Any) -> Any:
    """The engines that give their device memory to the trainer around each step: colocated, under the sync
    schedule (one-step-off generates while the trainer steps, so its engines keep theirs), of a kind that
    releases memory; None otherwise."""
    colocated = cfg.cluster.placement == "colocated" and cfg.schedule == "sync"
    return engines if colocated and ENGINE_KINDS.entry(cfg.cluster.engine).releases_memory else None


def _watched_by_reaper(orch: Orchestration, run_dir: Path | None) -> None:
    """The reaper of the run's Ray session writes `run_dir`'s summary and report if the driver is killed."""
    if orch.session is not None:
        orch.session.watch_run(run_dir)


def sampling_temperature(cfg: VerstConfig) -> float:
    """The temperature the trainer's logprobs are taken at: the rollouts' (greedy rollouts: the raw
    distribution's)."""
    return cfg.rollout.sampling.temperature or 1.0


def _load_in_background(load: Any, *args: Any) -> None:
    """Warm a cached `load(*args)` in a daemon thread; a failure is left to the caller's own call."""

    def run() -> None:
        with contextlib.suppress(Exception):
            load(*args)

    threading.Thread(target=run, name="verst-preload", daemon=True).start()
