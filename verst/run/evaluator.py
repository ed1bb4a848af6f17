"""The held-out evaluations of an RL run: on the rollout engines, or on a snapshot of the step's weights (by
`eval.backend` or the evaluation fleet); at most `eval.max_in_flight` outstanding, each logged at its step.

A score stands only when its samples' weight version is its step (`verst.eval.skip.accept`); a failed
evaluation is logged as `eval/skipped_<reason>` and training goes on (unless `eval.on_error = "stop"`).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verst.config import VerstConfig
from verst.data import held_out_prompts
from verst.eval.agentic import score_key
from verst.eval.backend import call_backend, in_daemon_thread, load_backend, retire_snapshots, snapshot_dir
from verst.eval.fleet import EvalFleet
from verst.eval.local import run_tokenizer, score_engines
from verst.eval.skip import EvalSkip, accept, skip_reason, skipped
from verst.rollout.from_config import request_batch
from verst.run.lanes import Lane
from verst.run.snapshots import EvalSnapshots

log = logging.getLogger(__name__)
Record = Callable[[int, dict[str, float]], None]  # (step, metrics): an evaluation's row, logged at its step


class Evaluator:
    """`served_version()`: the version the rollout engines serve; `trainer_version()`: the trainer's (an
    evaluation's lag is measured against it); `record(step, metrics)` logs a row. `snapshots` writes the
    step's weights for a snapshot evaluation; `fleet`: the evaluation fleet, if the run has one."""

    def __init__(self, cfg: VerstConfig, lanes: list[Lane], router_url: str, *, served_version: Callable[[], int],
                 trainer_version: Callable[[], int], record: Record, snapshots: EvalSnapshots,
                 fleet: EvalFleet | None = None):
        self.cfg, self.lanes, self.router_url = cfg, lanes, router_url
        self.served_version, self.trainer_version, self.record = served_version, trainer_version, record
        self.snapshots, self.fleet = snapshots, fleet
        self.history: list[tuple[int, float]] = []  # (step, score) in step order
        self.score_key = score_key(cfg)
        self._tasks: list[asyncio.Task] = []
        self._by_step: dict[int, asyncio.Task] = {}  # snapshot evaluations in flight: their snapshots stay
        self._last_step: int | None = None

    @property
    def on_engines(self) -> bool:
        """Mode 1: the evaluation shares the rollout engines (which must serve its step's weights); else a
        snapshot is scored, by the evaluation fleet (`eval.num_engines`) or by `eval.backend`."""
        return self.cfg.eval.backend is None and not self.cfg.eval.num_engines

    @property
    def multi_lora(self) -> bool:
        return self.lanes[0].adapter is not None

    def due(self, version: int) -> bool:
        return bool(self.cfg.eval.interval) and version % self.cfg.eval.interval == 0

    def in_flight(self) -> bool:
        return any(not task.done() for task in self._tasks)

    # ---- starting one ---------------------------------------------------------------------------
    async def start(self, step: int, extra: dict[str, float] | None = None) -> None:
        """Evaluate the weights of `step` in the background, logged at that step (with `extra`) once done.

        On the engines, training and generation go on meanwhile (the evaluation's requests go first) and the
        weights stay: the next push, or a colocated step, waits for it. Otherwise the weights are first
        written as a snapshot, then scored while training goes on. Past `eval.max_in_flight` outstanding,
        `eval.overflow` waits or skips the point."""
        extra = dict(extra or {})
        self._last_step = step
        if not await self._admit(step):
            self.record(step, extra | skipped("busy"))
            return
        if not self.on_engines:
            try:
                extra |= await self.snapshots.write(step)
            except Exception as error:
                self.record(step, extra | self._skip_or_raise(step, EvalSkip(
                    "export_failed", f"{type(error).__name__}: {error}")))
                return

        async def evaluate_and_log() -> None:
            self.record(step, {**extra, **await self.evaluate_or_skip(step)})

        task = asyncio.create_task(evaluate_and_log())
        self._tasks.append(task)
        if not self.on_engines:
            self._by_step[step] = task
            task.add_done_callback(functools.partial(self._retire, step))

    async def _admit(self, step: int) -> bool:
        """Room for one more evaluation: under `backpressure` wait for the oldest to finish; under `skip`
        False when `eval.max_in_flight` are outstanding."""
        await self.harvest()
        while len(self._tasks) >= self.cfg.eval.max_in_flight:
            if self.cfg.eval.overflow == "skip":
                log.info("evaluation of step %d skipped (busy): %d in flight (eval.max_in_flight)",
                         step, len(self._tasks))
                return False
            await asyncio.wait(self._tasks, return_when=asyncio.FIRST_COMPLETED)
            await self.harvest()
        return True

    # ---- scoring ----------------------------------------------------------------------------------
    async def evaluate(self, step: int) -> dict[str, float]:
        """Step `step`'s score: on its snapshot by the evaluation fleet or by `eval.backend`, else through the
        rollout engines, which must serve that version."""
        if self.on_engines:
            return await self._on_engines(step)
        snapshot = snapshot_dir(self.snapshots.run_dir, step) if step else Path(self.cfg.model.path)
        if self.cfg.eval.num_engines:
            if self.fleet is None:
                raise RuntimeError(f"eval.num_engines = {self.cfg.eval.num_engines} but the run has no "
                                   "evaluation fleet")
            return await self.fleet.score(snapshot, step)
        return await in_daemon_thread(call_backend, _backend(self.cfg.eval.backend), snapshot, step, self.cfg)

    async def _on_engines(self, step: int) -> dict[str, float]:
        """Every reply must carry the version the engines serve, which must be `step`. Multi-LoRA: each
        adapter on its own held-out prompts with its reward, under `lora/<name>/eval/...`."""
        served = self.served_version()
        if served != step:  # the engines serve other weights (sync.interval): nothing to measure
            raise EvalSkip("pin_violation", f"the engines serve version {served}, not step {step}")
        metrics: dict[str, float] = {}
        for lane in self.lanes:
            cfg = lane.cfg
            if cfg.model.kind == "diffusion":  # scored on the rollout side, where the image reward lives
                metrics |= lane.namespaced(await in_daemon_thread(lane.rollout.evaluate, served))
                continue
            scored = await score_engines(cfg, self.router_url, run_tokenizer(cfg.model.path), held_out_prompts(cfg),
                                         served, max_batch=request_batch(cfg, lane.rollout.router_url),
                                         lora_path=cfg.lora.served_adapter)
            metrics |= lane.namespaced(scored)
        return metrics | {"eval/weight_version": float(served), "eval/mixed_version_ratio": 0.0}

    async def evaluate_or_skip(self, step: int) -> dict[str, float]:
        """`evaluate(step)` within `fault.eval_timeout_s`, accepted only if it measured step `step`'s weights,
        with `eval/lag_steps` and `eval/duration_seconds`. A failure, a timeout or a pin violation becomes
        `eval/skipped_<reason>` (raised under `eval.on_error = "stop"`)."""
        start = time.perf_counter()
        try:
            # asyncio.timeout, not wait_for: Python 3.11's wait_for drops a cancel (Ctrl-C, a signal's stop) that
            # comes as the evaluation ends, and the run waiting on it would go on.
            async with asyncio.timeout(self.cfg.fault.eval_timeout_s):
                metrics = await self.evaluate(step)
            accept(metrics, step)
        except Exception as error:
            return self._skip_or_raise(step, error)
        duration = time.perf_counter() - start
        metrics |= {"eval/lag_steps": float(self.trainer_version() - step), "eval/duration_seconds": duration}
        if self.on_engines and self.cfg.schedule == "fully_async":  # the engines would have been generating
            metrics["eval/displaced_engine_seconds"] = duration * self.cfg.cluster.num_engines
        if self.score_key in metrics:  # in step order (backend scores may arrive out of it)
            bisect.insort(self.history, (step, metrics[self.score_key]))
        for lane in self.lanes if self.multi_lora else []:
            if lane.prefix + self.score_key in metrics:
                bisect.insort(lane.eval_history, (step, metrics[lane.prefix + self.score_key]))
        return metrics

    def _skip_or_raise(self, step: int, error: Exception) -> dict[str, float]:
        reason = skip_reason(error)
        if self.cfg.eval.on_error == "stop":
            if reason == "timeout":
                raise TimeoutError(f"the evaluation of step {step} did not finish within "
                                   f"{self.cfg.fault.eval_timeout_s:g} s (fault.eval_timeout_s)") from error
            raise error
        log.warning("evaluation of step %d skipped (%s): %s: %s", step, reason, type(error).__name__, error)
        return skipped(reason)

    # ---- waiting for them -------------------------------------------------------------------------
    async def harvest(self) -> None:
        """Forget the evaluations that have ended (raising a failure under `eval.on_error = "stop"`)."""
        done = [task for task in self._tasks if task.done()]
        self._tasks = [task for task in self._tasks if not task.done()]
        for task in done:
            await task

    async def settle(self) -> None:
        """Wait for every evaluation in flight (a failure is raised here)."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            await task

    async def settle_on_engines(self) -> None:
        """Before the engines' weights or memory change: wait for an evaluation that runs on them."""
        if self.on_engines:
            await self.settle()

    async def before_log(self) -> None:
        """Before a train step's row: an evaluation on the engines is logged first, so rows stay in step
        order (snapshot scores are logged when they arrive)."""
        await (self.settle_on_engines() if self.on_engines else self.harvest())

    async def drop(self) -> None:
        """Cancel every evaluation in flight and wait until they have stopped."""
        tasks, self._tasks = self._tasks, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def finish(self, version: int) -> None:
        """At the end of a run: the last version's score, unless an evaluation already measured it (the others
        end first: the last point is never skipped as busy)."""
        await self.settle()
        if self._last_step != version:
            await self.start(version)
            await self.settle()

    def _retire(self, step: int, _task: Any = None) -> None:
        self._by_step.pop(step, None)
        retire_snapshots(self.snapshots.run_dir, self.cfg.eval.keep_snapshots, in_use=set(self._by_step))


@functools.lru_cache(maxsize=4)
def _backend(path: str) -> Any:
    return load_backend(path)
