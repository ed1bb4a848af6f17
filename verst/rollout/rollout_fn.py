"""The default rollout fn (sync and one-step-off schedules): over-sample prompt groups, generate and score
them concurrently, keep groups that pass the dynamic filter, abort the rest at the end of the step.

Also the pieces the fully async worker reuses (`generate_and_reward`, `worker_hooks`), `run_rollout`
(calls the configured rollout fn and checks its batch) and the rollout-only dump mode.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import statistics
import time
from pathlib import Path

from verst.rewards import compute_rewards
from verst.rollout.agentic import tito_metrics
from verst.rollout.filters import apply_filter
from verst.rollout.generate import (
    CACHED_TOKENS_KEY,
    CONTINUED_KEY,
    ENGINE_PROMPT_TOKENS_KEY,
    PROMPT_TOO_LONG_KEY,
    generate_samples,
    mark_aborted,
)
from verst.rollout.plugins import RolloutBatch, RolloutContext
from verst.rollout.teacher import teacher_metrics
from verst.rollout.worker import GENERATE_ERROR_KEY, FinishGroup, GenerateGroup, GenerateSample
from verst.types import Group, Sample, Status, decode_samples, encode_samples, group_is_aborted

logger = logging.getLogger(__name__)
FINISHED = (Status.COMPLETED, Status.TRUNCATED)


class RolloutError(RuntimeError):
    """A rollout step could not produce its batch; the message carries the counts."""


# ---- one sample, one group ------------------------------------------------------------------
async def generate_and_reward(ctx: RolloutContext, sample: Sample, *, catch_errors: bool = True) -> Sample:
    """The generate fn within the concurrency limit, then the per-sample reward (unless `reward.group`).

    With `catch_errors`, an exception from the generate fn marks the sample ABORTED with the reason
    (the fully async worker passes False and counts them itself). A wrong return type or a sample
    that breaks its invariants always raises: that is a bug in the generate fn, not a bad episode.
    """
    async with ctx.state.limiter(ctx.rollout.concurrency):
        if sample.index in ctx.state.stopped:
            return mark_aborted(sample, "the rollout step ended before generation started")
        try:
            result = await ctx.generate_fn(ctx, sample)
        except Exception as e:
            if not catch_errors:
                raise
            where = f"sample {sample.index} (group {sample.group_index})"
            return mark_aborted(sample, failure_reason(ctx, e, "generate fn", where))
    if not isinstance(result, Sample):
        raise TypeError(f"generate fn {ctx.generate_fn!r} returned {type(result).__name__} for sample "
                        f"{sample.index}; expected Sample")
    result.validate()
    if not ctx.reward.group and result.status in FINISHED:
        await compute_rewards([result], ctx.reward_fn, group=False, key=ctx.reward.key)
    return result


async def generate_group_and_reward(ctx: RolloutContext, group: Group, *, catch_errors: bool = True) -> Group:
    """`rollout.request_per = "group"`: the group's samples in one engine request (one place of
    `rollout.concurrency`), then each finished sample's reward (unless `reward.group`). Errors as
    `generate_and_reward`'s, for the whole group."""
    async with ctx.state.limiter(ctx.rollout.concurrency):
        if group[0].index in ctx.state.stopped:
            return [mark_aborted(s, "the rollout step ended before generation started") for s in group]
        try:
            group = await generate_samples(ctx, group)
        except Exception as e:
            if not catch_errors:
                raise
            reason = failure_reason(ctx, e, "generate", f"group {group[0].group_index}")
            return [mark_aborted(s, reason) for s in group]
    finished = [s for s in group if s.status in FINISHED]
    if not ctx.reward.group and finished:
        await compute_rewards(finished, ctx.reward_fn, group=False, key=ctx.reward.key)
    return group


def failure_reason(ctx: RolloutContext, error: Exception, what: str, where: str) -> str:
    """Why a generation that raised `error` ended, logged unless the rollout is shutting down (the engine
    clients were closed under it: one line for the run, not each)."""
    if ctx.state.closing:
        return f"the rollout shut down during generation: {error!r}"
    logger.warning("%s failed for %s: %r", what, where, error)
    return f"{what} raised {error!r}"


async def score_group(ctx: RolloutContext, group: Group) -> None:
    """The per-group reward (`reward.group`), then the teacher's logprobs (on-policy distillation), on a
    group whose every sample finished."""
    if group_is_aborted(group):
        return
    if ctx.reward.group:
        await compute_rewards(group, ctx.reward_fn, group=True, key=ctx.reward.key)
    if ctx.teacher is not None:
        await ctx.teacher.score_group(group)


async def generate_group(ctx: RolloutContext, group: Group) -> Group:
    """Every sample of one prompt concurrently (or in one request: `rollout.request_per = "group"`), then the
    group reward if configured."""
    if ctx.rollout.request_per == "group":
        results = await generate_group_and_reward(ctx, group)
        await score_group(ctx, results)
        return results
    tasks = [asyncio.ensure_future(generate_and_reward(ctx, s)) for s in group]
    try:
        results = list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:  # a failing sample ends its siblings too: the group is one unit
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    await score_group(ctx, results)
    return results


@dataclasses.dataclass
class WorkerHooks:
    """What `AsyncRolloutWorker(generate_sample=... or generate_group=..., finish_group=...)` takes; pass
    `ctx.group_filter` to the buffer (`build_buffer(..., group_filter=)`), which filters on put."""

    generate_sample: GenerateSample | None
    finish_group: FinishGroup | None
    generate_group: GenerateGroup | None = None


def worker_hooks(ctx: RolloutContext) -> WorkerHooks:
    """The fully async schedule's generation + reward (per sample, or per group with `rollout.request_per =
    "group"`) and group-reward hook, from the same parts."""

    async def generate_sample(sample: Sample) -> Sample:
        return await generate_and_reward(ctx, sample, catch_errors=False)

    async def generate_whole_group(group: Group) -> Group:
        return await generate_group_and_reward(ctx, group, catch_errors=False)

    async def finish_group(group: Group) -> None:
        await score_group(ctx, group)

    finish = finish_group if ctx.reward.group or ctx.teacher is not None else None
    if ctx.rollout.request_per == "group":
        return WorkerHooks(None, finish, generate_whole_group)
    return WorkerHooks(generate_sample, finish)


async def abort_in_flight(ctx: RolloutContext, indices: set[int] | None = None) -> int:
    """Send `abort(rid)` to every control engine for each tracked request (of these sample indices);
    e.g. before `AsyncRolloutWorker.stop()`. Returns the number of requests aborted."""
    rids = [rid for rid, index in list(ctx.state.in_flight.items()) if indices is None or index in indices]
    await asyncio.gather(*(engine.abort(rid) for engine in ctx.control_engines for rid in rids))
    return len(rids)


# ---- the default rollout fn ---------------------------------------------------------------------
async def rollout(ctx: RolloutContext, n_groups: int) -> RolloutBatch:
    """`n_groups` groups that finished, were scored and passed `rollout.dynamic_filter`.

    Launches `rollout.over_sampling_batch_size` groups (default n_groups) at a time, and another
    round whenever the groups kept plus those still generating cannot reach `n_groups`. Every group
    not kept when the batch is full is a leftover: its requests are aborted by rid, then its prompt
    goes back to the source (`rollout.return_partial_to_source`) or is dropped. Filtered groups and
    failed ones (generation error, reward error, prompt too long) are dropped. After `ctx.max_rounds`
    rounds without a full batch the step fails with the counts.
    """
    if ctx.source is None:
        raise RolloutError("rollout: ctx.source is None; the default rollout fn draws prompts from a data source")
    over = ctx.rollout.over_sampling_batch_size or n_groups
    if n_groups < 1 or over < n_groups:
        raise RolloutError(f"rollout: n_groups = {n_groups} must be >= 1 and <= "
                           f"rollout.over_sampling_batch_size = {over}")
    return await _Step(ctx, n_groups, over).run()


class _Step:
    """One rollout step's bookkeeping: groups in flight and where each finished group went."""

    def __init__(self, ctx: RolloutContext, n_groups: int, over: int):
        self.ctx, self.n_groups, self.over = ctx, n_groups, over
        self.flights: dict[asyncio.Task, Group] = {}
        self.launched: dict[int, Group] = {}  # group_index -> the group as it came back (or went out)
        self.kept: list[Group] = []
        self.filtered: list[Group] = []
        self.failed: list[Group] = []
        self.surplus: list[Group] = []  # finished after the batch was full
        self.rounds = 0

    async def run(self) -> RolloutBatch:
        start = time.perf_counter()
        try:
            self._launch()
            while len(self.kept) < self.n_groups:
                if len(self.kept) + len(self.flights) < self.n_groups:
                    self._launch()
                done, _ = await asyncio.wait(self.flights, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(done, key=lambda t: self.flights[t][0].index):
                    self._finish(task.result(), self.flights.pop(task))
        finally:
            # Also on errors and cancellation: no request of this step may outlive it on the engines.
            aborted = await self._abort_leftovers()
        leftovers = sorted(self.surplus + aborted, key=lambda g: g[0].index)
        returned = self._return_to_source(leftovers)
        elapsed = time.perf_counter() - start
        kept = sorted(self.kept, key=lambda g: g[0].index)
        metrics = step_metrics(kept, self.filtered, list(self.launched.values()), key=self.ctx.reward.key,
                               elapsed_s=elapsed, zero_std=self.ctx.rollout.dynamic_filter == "zero_std")
        metrics.update({
            "rollout/failed_groups": float(len(self.failed)),
            "rollout/aborted_groups": float(len(leftovers)),
            "rollout/returned_groups": float(returned),
            "rollout/over_sampling_rounds": float(self.rounds),
        })
        return RolloutBatch(kept, metrics)

    def _launch(self) -> None:
        if self.rounds >= self.ctx.max_rounds:
            raise RolloutError(self._shortfall())
        self.rounds += 1
        for group in self.ctx.source.next_groups(self.over, self.ctx.rollout.n_samples_per_prompt):
            self.flights[asyncio.ensure_future(generate_group(self.ctx, group))] = group
            self.launched[group[0].group_index] = group

    def _finish(self, group: Group, launched: Group) -> None:
        if len(group) != len(launched):
            raise RolloutError(f"group {launched[0].group_index}: {len(group)} samples came back, {len(launched)} went")
        self.launched[launched[0].group_index] = group
        if group_is_aborted(group):
            self.failed.append(group)
        elif len(self.kept) >= self.n_groups:
            self.surplus.append(group)
        elif self.ctx.group_filter is None or apply_filter(self.ctx.group_filter, group):
            self.kept.append(group)
        else:
            self.filtered.append(group)

    async def _abort_leftovers(self) -> list[Group]:
        """Abort every request of the groups still in flight by rid, wait for them, cancel stragglers."""
        if not self.flights:
            return []
        state = self.ctx.state
        indices = {s.index for g in self.flights.values() for s in g}
        state.stopped |= indices
        pending = set(self.flights)
        try:
            deadline = time.monotonic() + self.ctx.abort_timeout_s
            while pending and time.monotonic() < deadline:
                # Re-sent each round: an abort that reaches an engine before its request does is a no-op.
                await abort_in_flight(self.ctx, indices)
                _, pending = await asyncio.wait(pending, timeout=0.25)
            for task in pending:
                task.cancel()  # the engine sees the client go away and aborts the request itself
            await asyncio.gather(*pending, return_exceptions=True)
        finally:
            state.stopped -= indices
        aborted = []
        for task, group in self.flights.items():
            if not task.cancelled() and task.exception() is None:
                group = task.result()
                self.launched[group[0].group_index] = group
            for s in group:
                if s.status not in FINISHED:
                    s.status = Status.ABORTED
                    s.metadata.setdefault(GENERATE_ERROR_KEY, "aborted at the end of the rollout step")
            aborted.append(group)
        self.flights.clear()
        return aborted

    def _return_to_source(self, leftovers: list[Group]) -> int:
        if not self.ctx.rollout.return_partial_to_source:
            return 0
        for group in leftovers:
            self.ctx.source.return_prompts(group)
        return len(leftovers)

    def _shortfall(self) -> str:
        reasons = [s.metadata.get(GENERATE_ERROR_KEY) or s.metadata.get("reward_error")
                   for g in self.failed for s in g]
        first = next((r for r in reasons if r), None)
        too_long = sum(1 for g in self.failed if any(PROMPT_TOO_LONG_KEY in s.metadata for s in g))
        return (
            f"rollout: after {self.rounds} rounds of rollout.over_sampling_batch_size = {self.over} groups "
            f"(ctx.max_rounds = {self.ctx.max_rounds}; {len(self.launched)} launched, {len(self.flights)} still "
            f"generating) only {len(self.kept)} of {self.n_groups} groups passed: "
            f"{len(self.filtered)} dropped by rollout.dynamic_filter = {self.ctx.rollout.dynamic_filter!r}, "
            f"{len(self.failed)} failed ({too_long} with a prompt too long); first failure: {first!r}"
        )


def step_metrics(
    kept: list[Group], filtered: list[Group], launched: list[Group], *, key: str | None = None,
    elapsed_s: float, zero_std: bool,
) -> dict[str, float]:
    """Metrics of one step. Rewards, lengths, truncation and versions describe the kept groups (the
    training batch); `raw_reward_mean` every scored group (kept and filtered, the policy's real
    success rate under DAPO); cache hits and tokens/s every engine reply of the step."""
    samples = [s for g in kept for s in g]
    every = [s for g in launched for s in g]
    m = {
        "rollout/kept_groups": float(len(kept)),
        "rollout/launched_groups": float(len(launched)),
        "rollout/filtered_groups": float(len(filtered)),
        "rollout/zero_std_groups_dropped": float(len(filtered)) if zero_std else 0.0,
        "rollout/prompt_too_long": float(sum(PROMPT_TOO_LONG_KEY in s.metadata for s in every)),
        "perf/rollout_tokens_per_s": sum(s.response_length for s in every) / elapsed_s if elapsed_s > 0 else 0.0,
        "time/rollout_s": elapsed_s,
    }
    if samples:
        m.update(sample_metrics(samples, key))
    scored = samples + [s for g in filtered for s in g]
    if scored:
        m["rollout/raw_reward_mean"] = statistics.fmean(s.reward_value(key) for s in scored)
    m.update(prefix_cache_metrics(every))
    return m


def sample_metrics(samples: list[Sample], key: str | None = None) -> dict[str, float]:
    """Rewards, lengths, truncation, weight versions and (multi-turn) token mismatches of the samples a
    train step consumes."""
    rewards = [s.reward_value(key) for s in samples]
    versions = [int(v) for s in samples for v in s.weight_versions]
    m = {
        "rollout/reward_mean": statistics.fmean(rewards),
        "rollout/reward_std": statistics.pstdev(rewards),
        "rollout/response_length_mean": statistics.fmean(s.response_length for s in samples),
        "rollout/truncated_ratio": sum(s.status is Status.TRUNCATED for s in samples) / len(samples),
        "rollout/mixed_version_ratio": sum(len(set(s.weight_versions)) > 1 for s in samples) / len(samples),
        "rollout/continued_ratio": sum(CONTINUED_KEY in s.metadata for s in samples) / len(samples),
    }
    if versions:
        m["rollout/weight_version_mean"] = statistics.fmean(versions)
    m.update(tito_metrics(samples))  # multi-turn samples only: re-tokenization mismatches
    m.update(teacher_metrics(samples))  # on-policy distillation only
    return m


def prefix_cache_metrics(samples: list[Sample]) -> dict[str, float]:
    """`rollout/prefix_cache_hit_rate`: prompt tokens the engines served from cache / prompt tokens sent."""
    prompt_tokens = sum(s.metadata.get(ENGINE_PROMPT_TOKENS_KEY, 0) for s in samples)
    if not prompt_tokens:
        return {}
    return {"rollout/prefix_cache_hit_rate": sum(s.metadata.get(CACHED_TOKENS_KEY, 0) for s in samples) / prompt_tokens}


# ---- calling a rollout fn; rollout-only dumps ---------------------------------------------------
async def run_rollout(ctx: RolloutContext, n_groups: int) -> RolloutBatch:
    """Call `ctx.rollout_fn`, check its batch against the contract, dump it in rollout-only mode."""
    batch = await ctx.rollout_fn(ctx, n_groups)
    if ctx.teacher is not None:  # a custom rollout fn's groups, which the default hooks did not see
        unscored = [g for g in batch.groups if any(s.teacher_logprobs is None for s in g)]
        await asyncio.gather(*(ctx.teacher.score_group(g) for g in unscored))
        if unscored:
            batch.metrics.update(teacher_metrics(batch.samples))
    check_batch(batch, n_groups, ctx.rollout.n_samples_per_prompt, where=f"rollout fn {ctx.rollout_fn!r}")
    if ctx.dump_dir is not None:
        dump_batch(batch, ctx.dump_dir / f"rollout_{ctx.state.step:06d}.samples")
    ctx.state.step += 1
    return batch


def check_batch(batch: RolloutBatch, n_groups: int, group_size: int, where: str = "rollout fn") -> None:
    """Exactly n_groups groups of group_size valid, finished, scored samples; flat float metrics."""
    if not isinstance(batch, RolloutBatch):
        raise TypeError(f"{where} returned {type(batch).__name__}; expected RolloutBatch")
    sizes = [len(g) for g in batch.groups]
    if len(sizes) != n_groups or any(n != group_size for n in sizes):
        raise ValueError(f"{where} returned groups of sizes {sizes}; expected {n_groups} groups of {group_size}")
    for s in batch.samples:
        s.validate()
        if s.status not in FINISHED or s.reward is None:
            raise ValueError(f"{where}: sample {s.index} (group {s.group_index}) has status {s.status.value} and "
                             f"reward {s.reward!r}; a batch holds finished, scored samples only")
    bad = {k: v for k, v in batch.metrics.items() if not isinstance(k, str) or not isinstance(v, (int, float))}
    if bad:
        raise TypeError(f"{where} returned non-numeric metrics {bad!r:.200}")


def dump_batch(batch: RolloutBatch, path: str | Path) -> Path:
    """Write a batch's samples (`encode_samples`, groups in order) and its metrics (`<path>.json`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(encode_samples(batch.samples))
    path.with_name(path.name + ".json").write_text(json.dumps(batch.metrics, sort_keys=True))
    return path


def load_dump(path: str | Path) -> RolloutBatch:
    """A batch written by `dump_batch`, for train-only runs: groups rebuilt from consecutive group_index."""
    path = Path(path)
    samples = decode_samples(path.read_bytes())
    groups: list[Group] = []
    for s in samples:
        if groups and groups[-1][0].group_index == s.group_index:
            groups[-1].append(s)
        else:
            groups.append([s])
    metrics_path = path.with_name(path.name + ".json")
    metrics = json.loads(metrics_path.read_text()) if metrics_path.exists() else {}
    return RolloutBatch(groups, metrics)
