"""What an RL run tells about itself: one metrics row per train step (with its time and the engines' idle
fraction since the previous step), the evaluations' rows at their steps, the live progress display, and at
the end `summary.json` and the HTML report.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.inference_client.fleet import IdleMeter
from verst.monitor import MetricsLogger, write_summary
from verst.monitor.progress import RunProgress
from verst.monitor.report import write_report
from verst.run.cores import CoreBudget
from verst.run.guard import Guard
from verst.run.lanes import Lane, adapter_score_lines, score_span
from verst.run.lanes import summary as lanes_summary

log = logging.getLogger(__name__)


class RunMonitor:
    """`fault_metrics()`: the engine supervisor's `fault/` metrics (read at every step); `restarts`: the
    times this run restarted after a trainer rank died; `started`: the run's start (perf_counter); `cores`:
    the core budget on CPU, told each step's work."""

    def __init__(self, cfg: VerstConfig, run_dir: Path, logger: MetricsLogger, progress: RunProgress, guard: Guard,
                 *, idle_meter: IdleMeter | None = None, fault_metrics: Callable[[], dict[str, float]] = dict,
                 restarts: int = 0, started: float | None = None, cores: CoreBudget | None = None):
        self.cfg, self.run_dir, self.logger, self.progress, self.guard = cfg, Path(run_dir), logger, progress, guard
        self.idle_meter, self.fault_metrics, self.restarts, self.cores = idle_meter, fault_metrics, restarts, cores
        self.started = time.perf_counter() if started is None else started

    async def log_step(self, metrics: dict[str, float], step_start: float, version: int,
                       lane: Lane | None = None) -> None:
        """Log one train step's metrics (with its time and the engines' idle fraction since the previous step)
        and show it on the progress display. Multi-LoRA: the step's metrics are its adapter's."""
        if lane is not None and lane.adapter is not None:
            metrics = {**lane.namespaced(metrics), f"{lane.prefix}train/steps": float(lane.steps)}
        metrics["perf/step_time_s"] = time.perf_counter() - step_start
        metrics["train/weight_version"] = float(version)
        idle = await self.engine_idle()
        if idle is not None:
            metrics["perf/engine_idle_fraction"] = idle
        if self.cores is not None:  # the threads this step had; the next steps' cores re-split from its work
            metrics.update(self.cores.plan.metrics())
            await self.guard("re-splitting the cores (set_cores)", "engine_call_timeout_s", self.cores.observe(metrics))
        metrics.update(self.fault_metrics())
        if self.restarts:
            metrics["fault/trainer_restarts"] = float(self.restarts)
        self.logger.log(metrics, step=version)
        self.progress.step(version, metrics)

    async def engine_idle(self) -> float | None:
        """The engines' idle fraction since the previous read (None: no meter, or no reading yet)."""
        if self.idle_meter is None:
            return None
        return await self.guard("reading the engines' busy time (get_server_info)", "engine_call_timeout_s",
                                self.idle_meter.read())

    def log(self, metrics: dict[str, float], step: int) -> None:
        self.logger.log(metrics, step=step)

    def log_evaluation(self, step: int, metrics: dict[str, float]) -> None:
        self.logger.log(metrics, step=step)
        self.progress.evaluated(step, metrics)

    def finish(self, version: int, history: list[tuple[int, float]], lanes: list[Lane],
               score_key: str) -> dict[str, Any]:
        """summary.json (the held-out score before and after, with the versions measured) and the report."""
        (v0, before), (v1, after) = score_span(history)  # no score: every evaluation was skipped
        summary = {
            f"{score_key}_before": before, f"{score_key}_after": after,
            "eval/version_before": v0, "eval/version_after": v1,
            "train/steps": version, "time/total_s": time.perf_counter() - self.started,
            "schedule": self.cfg.schedule, "sync/transport": self.cfg.sync.transport,
            **lanes_summary(lanes, score_key),
        }
        write_summary(self.run_dir, summary)
        report = write_report(self.run_dir)
        scores = "no evaluation" if before is None else \
            f"held-out greedy {score_key[5:]} {before:.1%} (version {v0}) -> {after:.1%} (version {v1})"
        if lanes[0].adapter is not None:  # multi-LoRA: the scores are the adapters'
            for line in adapter_score_lines(lanes, summary, score_key):
                log.info(line)
            scores = f"{len(lanes)} adapters, {sum(lane.steps for lane in lanes)} steps"
        log.info("%s in %.0f s; report %s", scores, summary["time/total_s"], report)
        return summary
