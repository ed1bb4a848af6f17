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
from verst.monitor.diagnosis import cause_text
from verst.monitor.postmortem import write_stopped
from verst.monitor.progress import RunProgress
from verst.monitor.report import write_report
from verst.monitor.segments import FINISHED, Segments
from verst.run.cores import CoreBudget
from verst.run.guard import Guard
from verst.run.lanes import Lane, adapter_score_lines, score_span
from verst.run.lanes import summary as lanes_summary

log = logging.getLogger(__name__)


def _no_fault_metrics(step_start: float) -> dict[str, float]:
    return {}


class RunMonitor:
    """`fault_metrics(step_start)`: the engine supervisor's `fault/` metrics and the step's engine outage
    (read at every step); `restarts`: the times this run restarted after a trainer rank died; `started`,
    `started_at`: this segment's start (perf_counter, Unix time); `cores`: the core budget on CPU, told each
    step's work. The run's segments are in `segments`."""

    def __init__(self, cfg: VerstConfig, run_dir: Path, logger: MetricsLogger, progress: RunProgress, guard: Guard,
                 *, idle_meter: IdleMeter | None = None, fault_metrics: Callable[[float], dict[str, float]] = _no_fault_metrics,
                 restarts: int = 0, started: float | None = None, started_at: float | None = None,
                 cores: CoreBudget | None = None):
        self.cfg, self.run_dir, self.logger, self.progress, self.guard = cfg, Path(run_dir), logger, progress, guard
        self.idle_meter, self.fault_metrics, self.restarts, self.cores = idle_meter, fault_metrics, restarts, cores
        self.started = time.perf_counter() if started is None else started
        self.segments = Segments(self.run_dir, self.started, time.time() if started_at is None else started_at)

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
        metrics.update(self.fault_metrics(step_start))
        if self.restarts:
            metrics["fault/trainer_restarts"] = float(self.restarts)
        self.logger.log(metrics, step=version)
        self.segments.update(version)
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

    def begin(self, version: int) -> None:
        """The loop starts at `version` (a resumed run: its checkpoint's): this segment's first step."""
        self.segments.begin(version)

    def finish(self, version: int, history: list[tuple[int, float]], lanes: list[Lane],
               score_key: str) -> dict[str, Any]:
        """summary.json (the held-out score before and after, with the versions measured; the time over every
        segment of the run) and the report."""
        self.segments.close(FINISHED)
        summary = self.summary(version, history, lanes, score_key)
        write_summary(self.run_dir, summary)
        report = write_report(self.run_dir)
        (v0, before), (v1, after) = score_span(history)
        images = self.cfg.model.kind == "diffusion"  # the mean reward of the held-out images, not a rate
        scored, shown = ("mean reward", ".3f") if images else (f"greedy {score_key[5:]}", ".1%")
        scores = "no evaluation" if before is None else \
            f"held-out {scored} {before:{shown}} (version {v0}) -> {after:{shown}} (version {v1})"
        if lanes[0].adapter is not None:  # multi-LoRA: the scores are the adapters'
            for line in adapter_score_lines(lanes, summary, score_key):
                log.info(line)
            scores = f"{len(lanes)} adapters, {sum(lane.steps for lane in lanes)} steps"
        log.info("%s in %.0f s%s; report %s", scores, summary["time/total_s"], _over(self.segments), report)
        return summary

    def stopped(self, version: int, history: list[tuple[int, float]], lanes: list[Lane], score_key: str,
                end: str) -> list[str]:
        """A run that ends early (`end`: "interrupted by SIGTERM", "failed: ..."): summary.json and the report
        with what ran. Returns the lines that say what was written, or why not (a full disk): the run's error
        is the one to raise, so nothing here raises."""
        lines = []
        try:
            self.segments.close(end)
        except OSError as error:
            lines.append(f"{self.segments.path} not updated: {cause_text(error)}")
        summary = {**self.summary(version, history, lanes, score_key), "stopped": end}
        return write_stopped(self.run_dir, summary) + lines

    def summary(self, version: int, history: list[tuple[int, float]], lanes: list[Lane],
                score_key: str) -> dict[str, Any]:
        (v0, before), (v1, after) = score_span(history)  # no score: every evaluation was skipped
        segments = self.segments.all
        return {
            f"{score_key}_before": before, f"{score_key}_after": after,
            "eval/version_before": v0, "eval/version_after": v1,
            "train/steps": version, "time/total_s": sum(segment.seconds for segment in segments),
            "segments": [segment.row() for segment in segments],
            "schedule": self.cfg.schedule, "sync/transport": self.cfg.sync.transport,
            **lanes_summary(lanes, score_key),
        }


def _over(segments: Segments) -> str:
    """' over 2 segments (100 s, 235 s)' for a resumed run; '' for a run of one segment."""
    rows = segments.all
    return "" if len(rows) < 2 else f" over {len(rows)} segments ({', '.join(f'{s.seconds:.0f} s' for s in rows)})"
