"""Starting an RL run: Ray placement, engines (policy, teacher, evaluation fleet), trainer ranks, the rollout
managers with their routers and the weight syncer, all stopped on exit (`open_rl_run`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from verst.config import VerstConfig, batch_plan
from verst.config.adapters import adapter_names, adapter_run_config
from verst.engines.kinds import engine_kind, resolve_engine_python
from verst.eval.fleet import open_eval_fleet
from verst.eval.local import run_tokenizer
from verst.inference_client.client import Timeouts
from verst.inference_client.fleet import EngineFleet, IdleMeter
from verst.models.loader import check_same_tokenizer
from verst.monitor import MetricsLogger, prepare_run_dir
from verst.monitor.progress import RunProgress
from verst.orchestration import Orchestration, RouterSpec
from verst.orchestration.health import EngineSupervisor, restart_weights
from verst.orchestration.watchdog import RunFailure, RunProcesses, Watchdog, failure_report
from verst.orchestration.weight_sync import TrainerWeightSync
from verst.schedules import checkpointing
from verst.schedules.checkpointing import RunCheckpointer
from verst.schedules.lanes import Lane, push_adapters
from verst.schedules.rollout_side import build_rollout_parts, prepare_rollout_parts
from verst.schedules.run import RLRun
from verst.trainer.backend import fsdp2_backend


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
    _load_in_background(run_tokenizer, cfg.model.path)  # the evaluations' (transformers' import), while Ray starts
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
