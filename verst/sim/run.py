"""A simulated RL run: `open_sim_run` is `open_rl_run` with simulated engines and trainer. The control plane is
the real one: sglang-router in front of the engines, the rollout manager with its data source, rollout fn,
buffer and fully async worker, the engine client, the session server for agentic turns, the weight syncer
and its fan-out, the engine supervisor, the run's parts (`assemble`) and the schedule's own loop. Every run
writes the usual run directory and report, and `scale.json`: what the control plane cost, how busy the
engines were, the weight pushes, the faults and where every served group went.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from verst.config import VerstConfig, batch_plan
from verst.inference_client.client import Timeouts
from verst.inference_client.fleet import EngineFleet, IdleMeter
from verst.monitor import MetricsLogger, prepare_run_dir
from verst.monitor.heap import settle_heap
from verst.orchestration.health import EngineSupervisor
from verst.orchestration.watchdog import RunProcesses, Watchdog
from verst.orchestration.weight_sync import TrainerWeightSync
from verst.rollout.from_config import build_rollout_parts
from verst.run.rl_run import RLRun
from verst.run.setup import absolute_paths, logged_router_spec
from verst.run.start import Actors, assemble
from verst.run.weights import RestartSource
from verst.sim.accounting import LEDGER
from verst.sim.clock import SimClock
from verst.sim.config import SimConfig
from verst.sim.faults import FaultInjector
from verst.sim.fleet_group import SimFleetGroup
from verst.sim.local_manager import LocalRolloutManager
from verst.sim.measure import CpuMeter, engine_window, rss_bytes
from verst.sim.setup import fleet_spec
from verst.sim.summary import scale_summary
from verst.sim.trainer import SimBackend, SimTrainerRanks
from verst.sim.workload import AGENTS, write_data

log = logging.getLogger(__name__)
SCALE_FILE = "scale.json"
RSS_PERIOD_S = 0.5


@contextlib.asynccontextmanager
async def open_sim_run(cfg: VerstConfig, restarts: int = 0, *, sim: SimConfig) -> AsyncIterator[RLRun]:
    """Start the simulated fleet, the rollout manager (router first) and the simulated trainer; yield the run;
    on exit stop everything and write scale.json. `cfg` is already simulated (`setup.simulated_config`)."""
    started, started_at = time.perf_counter(), time.time()
    cfg = absolute_paths(cfg)
    run_dir = prepare_run_dir(cfg, {"sim": sim.model_dump(mode="json")})
    (run_dir / "logs").mkdir(exist_ok=True)
    write_data(sim, Path(cfg.data.train_path), Path(cfg.data.test_path))
    LEDGER.reset()
    logger = MetricsLogger.for_run(run_dir, tensorboard=cfg.logging.tensorboard, wandb=cfg.logging.wandb,
                                   wandb_project=cfg.logging.wandb_project, name=cfg.name)
    clock = SimClock(sim.speedup)
    with logger, SimFleetGroup(fleet_spec(cfg, sim), processes=sim.fleet_processes, log_dir=run_dir / "logs") as engines:
        urls = engines.urls
        manager = LocalRolloutManager(functools.partial(build_rollout_parts, cfg),
                                      router=logged_router_spec(cfg, cfg))
        trainer = SimTrainerRanks(SimBackend(sim.total_params, sim.bytes_per_param),
                                  sim.trainer_costs(cfg.cluster.trainer_ranks), clock, cfg.plugins)
        recorder = ScaleRecorder(cfg, sim, engines, manager, trainer)
        try:
            await asyncio.to_thread(manager.start, urls)
            async with EngineFleet(urls, timeouts=Timeouts(control=cfg.fault.engine_call_timeout_s)) as fleet:
                run, supervisor, syncer = _assemble(cfg, run_dir, engines, manager, trainer, fleet, logger, started,
                                                    started_at, restarts)
                try:
                    await run.push_all()
                    await run.monitor.engine_idle()
                    settle_heap()  # in the `verst` command's process, which holds the rollout manager here
                    async with supervisor, FaultInjector(sim, engines, lambda: run.version) as faults, \
                            recorder.window(run):
                        with run.monitor.progress:
                            yield run
                        recorder.end(faults, supervisor)
                except Exception:
                    run.checkpointer.abandon()
                    await run.evaluator.drop()
                    await syncer.close_within(10.0)
                    raise
                finally:
                    await run.stop()
        finally:
            await asyncio.to_thread(manager.shutdown)
            trainer.shutdown()
            if recorder.ended:
                recorder.write(run_dir, manager.unfinished)


def _assemble(cfg: VerstConfig, run_dir: Path, engines: SimFleetGroup, manager: LocalRolloutManager,
              trainer: SimTrainerRanks, fleet: EngineFleet, logger: MetricsLogger, started: float, started_at: float,
              restarts: int) -> tuple[RLRun, EngineSupervisor, TrainerWeightSync]:
    """The run's parts over the simulated handles, as `open_rl_run` builds them over the Ray ones."""
    urls = engines.urls
    processes = RunProcesses(run_dir, engines, trainer, [manager], run_dir / "logs")
    syncer = TrainerWeightSync(trainer, cfg.sync, urls, fleet=fleet, device="cpu", snapshot_dir=str(run_dir / "weights"),
                               source_model=cfg.model.path, control_timeout_s=cfg.fault.engine_call_timeout_s)
    watchdog = Watchdog(run_dir, processes)
    supervisor = EngineSupervisor(
        cfg.fault, engines, [manager], urls, processes, watchdog, RestartSource(cfg, syncer, trainer, run_dir / "weights"),
        served_version=lambda: syncer.version or 0, on_restart=syncer.engine_replaced)
    actors = Actors(trainer, engines, None, None, {None: manager}, {})
    run = assemble(cfg, batch_plan(cfg), run_dir, actors, syncer, supervisor, watchdog, None, logger,
                   idle_meter=IdleMeter(fleet), router_url=urls[0], restarts=restarts, started=started,
                   started_at=started_at)
    return run, supervisor, syncer


class ScaleRecorder:
    """Marks the control plane's CPU and the engines' counters when the loop begins and ends; `write` puts the
    scale summary into RUN/scale.json."""

    def __init__(self, cfg: VerstConfig, sim: SimConfig, engines: SimFleetGroup, manager: LocalRolloutManager,
                 trainer: SimTrainerRanks):
        self.cfg, self.sim, self.engines, self.manager, self.trainer = cfg, sim, engines, manager, trainer
        self.ended = False
        self.result: dict[str, Any] = {}

    def _meter(self) -> CpuMeter:
        threads = {"rollout_manager": self.manager.thread_id}
        syncer = self.trainer.weight_sync
        router = self.manager.pids.get("router")
        return CpuMeter({k: v for k, v in threads.items() if v}, {"router": [router] if router else [],
                                                                  "weight_sync": [syncer.pid] if syncer else [],
                                                                  "fleet": self.engines.pids})

    @contextlib.asynccontextmanager
    async def window(self, run: RLRun) -> AsyncIterator[None]:
        """The measurement opens once the trainer has taken `sim.warmup_steps` steps and closes once it has taken
        the run's last. Each edge is marked inside the step that reaches it, before the run goes on, so that the
        next rollout's first requests, or the final evaluation's, fall on one side of it only; the final
        evaluation and the worker's stop, during which the engines run out of work, are not the steady state it
        measures."""
        last_step = batch_plan(self.cfg).total_train_steps

        def edge(version: int) -> None:
            if version == self.sim.warmup_steps:
                self.begin()
            if version == last_step and hasattr(self, "cpu_start"):
                self.close()

        if run.version >= self.sim.warmup_steps:
            self.begin()
        run.watch_version(edge)
        sampling = asyncio.create_task(self._sample_rss())
        try:
            yield
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)

    async def _sample_rss(self) -> None:
        """The driver's peak memory in the window."""
        while True:
            if hasattr(self, "cpu_start") and not hasattr(self, "cpu_end"):
                self.rss_peak = max(self.rss_peak, rss_bytes(os.getpid()))
            await asyncio.sleep(RSS_PERIOD_S)

    def begin(self) -> None:
        self.cpu_start, self.engines_start = self._meter().mark(), self.engines.stats()
        self.agents_start = AGENTS.finished
        self.rss_start = self.rss_peak = rss_bytes(os.getpid())

    def close(self) -> None:
        self.cpu_end, self.engines_end = self._meter().mark(), self.engines.stats()
        self.agents_end, self.rss_end = AGENTS.finished, rss_bytes(os.getpid())

    def end(self, faults: FaultInjector, supervisor: EngineSupervisor) -> None:
        if not hasattr(self, "cpu_start"):  # the run ended within its warm-up
            raise RuntimeError(f"sim.warmup_steps = {self.sim.warmup_steps} is not below the run's steps: nothing "
                               "was measured")
        if not hasattr(self, "cpu_end"):  # the run ended before its last step (a stop, a fault)
            self.close()
        self.result = {"cpu_s": CpuMeter.between(self.cpu_start, self.cpu_end),
                       "load_average": [self.cpu_start.load, self.cpu_end.load],
                       "engines": engine_window(self.engines_start, self.engines_end),
                       "agent_trajectories": self.agents_end - self.agents_start,
                       "faults": {**faults.summary(), "engine_restarts": supervisor.restarts},
                       "driver_rss_bytes": {"start": self.rss_start, "peak": max(self.rss_peak, self.rss_end),
                                            "end": self.rss_end},
                       "train_step_sim_s": list(self.trainer.step_seconds)}
        self.ended = True

    def write(self, run_dir: Path, unfinished: int) -> dict[str, Any]:
        queued = LEDGER.buffer.queued_groups() if LEDGER.buffer is not None else []
        summary = scale_summary(self.cfg, self.sim, self.result, run_dir,
                                lambda dropped: LEDGER.report(queued, dropped, unfinished))
        (run_dir / SCALE_FILE).write_text(json.dumps(summary, indent=1))
        return summary
