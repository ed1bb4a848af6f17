"""The held-out evaluations of an RL run, as named steps of `RLRun`: on the rollout engines, or on a snapshot
(by `eval.backend` or the evaluation fleet); at most `eval.max_in_flight` outstanding, each logged at its step.

A score stands only when its samples' weight version is its step (`verst.eval.skip.accept`); a failed
evaluation is logged as `eval/skipped_<reason>` and training goes on (unless `eval.on_error = "stop"`).
"""

from __future__ import annotations

import asyncio
import bisect
import functools
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from verst.eval import engine_greedy_generate, evaluate_greedy
from verst.eval.agentic import evaluate_agentic
from verst.eval.backend import (
    call_backend,
    in_daemon_thread,
    link_snapshot,
    load_backend,
    retire_snapshots,
    snapshot_dir,
)
from verst.eval.local import held_out_prompts, run_tokenizer
from verst.eval.skip import EvalSkip, accept, skip_reason, skipped
from verst.inference_client.client import EngineClient
from verst.schedules.rollout_side import request_batch

if TYPE_CHECKING:
    from verst.eval.fleet import EvalFleet
    from verst.schedules.run import RLRun


class EvaluationSteps:
    """Mixed into `RLRun`: starting, settling and logging its evaluations."""

    _evaluations: list[asyncio.Task]
    _evaluating: dict[int, asyncio.Task]  # snapshot evaluations in flight, by step: their snapshots stay
    eval_fleet: EvalFleet | None
    _last_eval_step: int | None

    @property
    def on_engines(self: RLRun) -> bool:
        """Mode 1: the evaluation shares the rollout engines (which must serve its step's weights); else a
        snapshot is scored, by the evaluation fleet (`eval.num_engines`) or by `eval.backend`."""
        return self.cfg.eval.backend is None and not self.cfg.eval.num_engines

    def evaluation_in_flight(self: RLRun) -> bool:
        return any(not task.done() for task in self._evaluations)

    async def evaluate(self: RLRun, step: int | None = None) -> dict[str, float]:
        """Step `step`'s (default: `version`'s) score: on its snapshot by the evaluation fleet or by
        `eval.backend`, else through the rollout engines, which must serve that version."""
        step = self.version if step is None else step
        if not self.on_engines:
            snapshot = snapshot_dir(self.run_dir, step) if step else Path(self.cfg.model.path)
            if self.cfg.eval.num_engines:
                if self.eval_fleet is None:
                    raise RuntimeError(f"eval.num_engines = {self.cfg.eval.num_engines} but the run has no "
                                       "evaluation fleet")
                return await self.eval_fleet.score(snapshot, step)
            return await in_daemon_thread(call_backend, _backend(self.cfg.eval.backend), snapshot, step, self.cfg)
        return await self.evaluate_on_engines(step)

    async def evaluate_on_engines(self: RLRun, step: int) -> dict[str, float]:
        """Held-out greedy accuracy (or agent success) through the engines; every reply must carry the
        version the syncer pushed, which must be `step`. Multi-LoRA: each adapter on its own held-out prompts
        with its reward, under `lora/<name>/eval/...`."""
        served = self.syncer.version or 0
        if served != step:  # the engines serve other weights (sync.interval): nothing to measure
            raise EvalSkip("pin_violation", f"the engines serve version {served}, not step {step}")
        if not self.multi_lora:
            return await self._score_on_engines(self.cfg, self.rollout, served)
        metrics: dict[str, float] = {}
        for lane in self.lanes:
            metrics |= lane.namespaced(await self._score_on_engines(lane.cfg, lane.rollout, served))
        return metrics | {"eval/weight_version": float(served), "eval/mixed_version_ratio": 0.0}

    async def _score_on_engines(self: RLRun, cfg: Any, rollout: Any, served: int) -> dict[str, float]:
        tokenizer, prompts, version = run_tokenizer(cfg.model.path), held_out_prompts(cfg), str(served)
        if cfg.rollout.agent_fn:  # a tool-using task: the first reply is a tool call, so run whole episodes
            async with EngineClient(self.router_url, affinity=True, lora_path=cfg.lora.served_adapter) as client:
                return await evaluate_agentic(cfg, client, tokenizer, prompts, expect_version=version)
        max_new = cfg.eval.max_response_tokens or cfg.rollout.max_response_tokens
        generate = engine_greedy_generate(self.router_url, max_new, expect_version=version,
                                          max_batch=request_batch(cfg, rollout.router_url),
                                          lora_path=cfg.lora.served_adapter)
        metrics = await asyncio.to_thread(evaluate_greedy, prompts, generate, tokenizer, cfg.reward, cfg.data, max_new)
        # every reply carried `version` (else MixedVersionError): the mean is it, none mixed
        return metrics | {"eval/weight_version": float(served), "eval/mixed_version_ratio": 0.0}

    async def start_evaluation(self: RLRun, extra: dict[str, float] | None = None) -> None:
        """Evaluate `version` in the background, logged at that step (with `extra`) once it is done.

        On the engines, training and generation go on meanwhile (the evaluation's requests go first) and the
        weights stay: the next push, or a colocated step, waits for it. With `eval.backend` or the evaluation
        fleet, the weights are first written as a snapshot (a disk-transport snapshot of the step is reused),
        then scored while training goes on. Past `eval.max_in_flight` outstanding, `eval.overflow` waits or skips the point.
        """
        step, extra = self.version, dict(extra or {})
        self._last_eval_step = step
        if not await self._admit(step):
            self._log_evaluation(step, extra | skipped("busy"))
            return
        if not self.on_engines:
            try:
                extra |= await self._write_snapshot(step)
            except Exception as error:
                self._log_evaluation(step, extra | self._skip_or_raise(step, EvalSkip(
                    "export_failed", f"{type(error).__name__}: {error}")))
                return

        async def evaluate_and_log() -> None:
            self._log_evaluation(step, {**extra, **await self.evaluate_or_skip(step)})

        task = asyncio.create_task(evaluate_and_log())
        self._evaluations.append(task)
        if not self.on_engines:
            self._evaluating[step] = task
            task.add_done_callback(functools.partial(self._retire, step))

    async def evaluate_or_skip(self: RLRun, step: int) -> dict[str, float]:
        """`evaluate(step)` within `fault.eval_timeout_s`, accepted only if it measured step `step`'s
        weights, with `eval/lag_steps` and `eval/duration_seconds`. A failure, a timeout or a pin violation
        becomes `eval/skipped_<reason>` (raised under `eval.on_error = "stop"`)."""
        start = time.perf_counter()
        try:
            metrics = await asyncio.wait_for(self.evaluate(step), self.cfg.fault.eval_timeout_s)
            accept(metrics, step)
        except Exception as error:
            return self._skip_or_raise(step, error)
        duration = time.perf_counter() - start
        metrics |= {"eval/lag_steps": float(self.version - step), "eval/duration_seconds": duration}
        if self.on_engines and self.cfg.schedule == "fully_async":  # the engines would have been generating
            metrics["eval/displaced_engine_seconds"] = duration * self.cfg.cluster.num_engines
        if self.score_key in metrics:  # in step order (backend scores may arrive out of it)
            bisect.insort(self.eval_history, (step, metrics[self.score_key]))
        for lane in self.lanes if self.multi_lora else []:
            if lane.prefix + self.score_key in metrics:
                bisect.insort(lane.eval_history, (step, metrics[lane.prefix + self.score_key]))
        return metrics

    def _skip_or_raise(self: RLRun, step: int, error: Exception) -> dict[str, float]:
        reason = skip_reason(error)
        if self.cfg.eval.on_error == "stop":
            if reason == "timeout":
                raise TimeoutError(f"the evaluation of step {step} did not finish within "
                                   f"{self.cfg.fault.eval_timeout_s:g} s (fault.eval_timeout_s)") from error
            raise error
        print(f"[{self.cfg.schedule}] evaluation of step {step} skipped ({reason}): "
              f"{type(error).__name__}: {str(error)[:300]}", flush=True)
        return skipped(reason)

    def _log_evaluation(self: RLRun, step: int, metrics: dict[str, float]) -> None:
        self.logger.log(metrics, step=step)
        self.progress.evaluated(step, metrics)

    async def _admit(self: RLRun, step: int) -> bool:
        """Room for one more evaluation: under `backpressure` wait for the oldest to finish; under `skip`
        False when `eval.max_in_flight` are outstanding."""
        await self._harvest()
        while len(self._evaluations) >= self.cfg.eval.max_in_flight:
            if self.cfg.eval.overflow == "skip":
                print(f"[{self.cfg.schedule}] evaluation of step {step} skipped (busy): "
                      f"{len(self._evaluations)} in flight (eval.max_in_flight)", flush=True)
                return False
            await asyncio.wait(self._evaluations, return_when=asyncio.FIRST_COMPLETED)
            await self._harvest()
        return True

    async def _harvest(self: RLRun) -> None:
        """Forget the evaluations that have ended (raising a failure under `eval.on_error = "stop"`)."""
        done = [task for task in self._evaluations if task.done()]
        self._evaluations = [task for task in self._evaluations if not task.done()]
        for task in done:
            await task

    async def _write_snapshot(self: RLRun, step: int) -> dict[str, float]:
        """The Hugging Face snapshot `eval.backend` or the evaluation fleet reads: step 0 is `model.path` itself, a disk-transport
        snapshot of the step is linked, else the trainer ranks export (a pause of training)."""
        from verst.sync.disk import snapshot_path
        from verst.trainer.backend import export_backend

        if step == 0:
            return {}
        start, target = time.perf_counter(), snapshot_dir(self.run_dir, step)
        weights = snapshot_path(self.run_dir / "weights", step)
        if self.cfg.sync.transport == "disk" and weights.is_dir() and not self.cfg.lora.enabled:
            await asyncio.to_thread(link_snapshot, weights, target)
            return {"eval/export_seconds": time.perf_counter() - start, "eval/snapshot_reused": 1.0}
        export = target.with_name(f".tmp-{target.name}")
        await self.guard(f"exporting the evaluation snapshot of step {step}", "step_timeout_s",
                         asyncio.to_thread(self.trainer.apply, export_backend, str(export), self.cfg.lora.enabled))
        _move_export(export, target, self.cfg.lora.enabled)
        return {"eval/export_seconds": time.perf_counter() - start, "eval/snapshot_reused": 0.0}

    def _retire(self: RLRun, step: int, _task: Any = None) -> None:
        self._evaluating.pop(step, None)
        retire_snapshots(self.run_dir, self.cfg.eval.keep_snapshots, in_use=set(self._evaluating))

    async def settle_evaluation(self: RLRun) -> None:
        """Wait for every evaluation in flight (a failure is raised here)."""
        tasks, self._evaluations = self._evaluations, []
        for task in tasks:
            await task

    async def settle_engine_evaluation(self: RLRun) -> None:
        """Before the engines' weights or memory change: wait for an evaluation that runs on them."""
        if self.on_engines:
            await self.settle_evaluation()

    async def drop_evaluation(self: RLRun) -> None:
        """Cancel every evaluation in flight and wait until they have stopped."""
        tasks, self._evaluations = self._evaluations, []
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def evaluate_last_version(self: RLRun) -> None:
        """At the end of a run: the last version's score, unless an evaluation already measured it (the
        others end first: the last point is never skipped as busy)."""
        await self.settle_evaluation()
        if self._last_eval_step != self.version:
            await self.start_evaluation()
            await self.settle_evaluation()


def _move_export(export: Path, target: Path, lora: bool) -> None:
    """An export into place; with LoRA its merged model (the adapter alone is not a full checkpoint)."""
    import shutil

    source = export / "merged" if lora else export
    shutil.rmtree(target, ignore_errors=True)
    source.rename(target)
    shutil.rmtree(export, ignore_errors=True)


@functools.lru_cache(maxsize=4)
def _backend(path: str) -> Any:
    return load_backend(path)
