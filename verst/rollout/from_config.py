"""The rollout side of an RL run, built inside the rollout manager's actor: data source, rollout
context and (fully async) the buffer and worker. Apart from `run`, so that actor does not load the
trainer's stack (torch.distributed, FSDP2, the weight transports) while the others start.
"""

from __future__ import annotations

import asyncio
import collections
import functools

from verst.config import VerstConfig, batch_plan, load_object
from verst.config.imports import import_plugins
from verst.data import PromptSource, held_out_prompts
from verst.inference_client.client import EngineClient
from verst.models import load_tokenizer
from verst.monitor.samples import append_samples
from verst.rollout import (
    AsyncRolloutWorker,
    RolloutContext,
    build_buffer,
    discard_handler,
    prefix_cache_metrics,
    run_rollout,
    sample_metrics,
    worker_hooks,
)
from verst.rollout.admission import StalenessGate
from verst.rollout.buffer import DiscardReason, OnDiscard
from verst.rollout.images import evaluate_images, generate_image
from verst.rollout.manager import RolloutEndpoints, RolloutParts
from verst.rollout.teacher import TeacherScorer
from verst.types import Group


async def build_rollout_parts(cfg: VerstConfig, endpoints: RolloutEndpoints) -> RolloutParts:
    """Data source, rollout context, and (fully async) the buffer and worker, from the config (its `plugins`
    imported first: the names they register are looked up here)."""
    import_plugins(cfg.plugins)
    images = cfg.model.kind == "diffusion"
    tokenizer = None if images else load_tokenizer(cfg.model.path)  # a denoiser's prompt is its class
    source = load_object(cfg.data.source, "data.source")(cfg.data) if cfg.data.source else PromptSource.from_config(cfg.data)
    engine = EngineClient(endpoints.router_url or endpoints.engine_urls[0], max_connections=cfg.rollout.concurrency,
                          max_batch=request_batch(cfg, endpoints.router_url),
                          generate_retries=cfg.fault.generate_retries if cfg.fault.tolerate_engines else 0,
                          lora_path=cfg.lora.served_adapter)  # a LoRA run samples base + its adapter
    control = [EngineClient(url) for url in endpoints.engine_urls]  # the router has no abort route
    teacher = None
    if endpoints.teacher_urls:  # on-policy distillation: the teacher's engines score every finished group
        teacher = TeacherScorer([EngineClient(url, max_connections=cfg.rollout.concurrency)
                                 for url in endpoints.teacher_urls],
                                temperature=cfg.rollout.sampling.temperature, concurrency=cfg.rollout.concurrency)
    image_fn = {"generate_fn": generate_image} if images and cfg.rollout.generate_fn is None else {}
    ctx = RolloutContext.from_config(cfg, engine, tokenizer, source, control_engines=control, teacher=teacher,
                                     **image_fn)
    last: dict[str, float] = {}

    async def generate_batch(rollout_id: int, weight_version: int) -> list[Group]:
        batch = await run_rollout(ctx, cfg.rollout.batch_size)
        last.clear()
        last.update(batch.metrics)
        return batch.groups

    def metrics() -> dict[str, float]:
        out = dict(last)
        last.clear()
        if engine.retried:  # generations sent again after their engine went away (fault tolerance)
            out["fault/requests_retried_total"] = float(engine.retried)
        return out

    async def close() -> None:
        ctx.state.closing = True  # generations cut short by closing the clients are not errors
        await asyncio.gather(engine.close(), *(c.close() for c in control), ctx.aclose())

    parts = RolloutParts(generate_batch=generate_batch, source=source, close=close, metrics=metrics,
                         batch_metrics=functools.partial(batch_metrics, key=cfg.reward.key))
    if images:  # scored here, where the image reward lives; the held-out prompts are read at the first evaluation
        held_out = functools.cache(functools.partial(held_out_prompts, cfg))
        parts.evaluate = lambda version: evaluate_images(ctx, held_out(), version, cfg.run_dir)
    if cfg.logging.sample_groups_per_step and cfg.run_dir:
        # one step off: a batch is generated a step ahead of its first train step; else the next step takes it
        ahead = batch_plan(cfg).train_steps_per_rollout if cfg.schedule == "one_step_off" else None
        parts.record_batch = functools.partial(record_samples, cfg.run_dir, cfg.logging.sample_groups_per_step, ahead)
    if cfg.schedule == "fully_async":
        plan = batch_plan(cfg)
        gate = admission_gate(cfg)
        discarded: collections.Counter[str] = collections.Counter()
        on_discard = counted(discard_handler(cfg.buffer.unused, source.return_prompts), gate, discarded)
        parts.buffer = build_buffer(cfg.buffer, plan.buffer_capacity_groups, on_discard, group_filter=ctx.group_filter)
        hooks = worker_hooks(ctx)
        parts.worker = AsyncRolloutWorker.from_config(
            cfg.rollout, source, parts.buffer, generate_sample=hooks.generate_sample,
            generate_group=hooks.generate_group, finish_group=hooks.finish_group,
            on_leftover=source.return_prompts if cfg.buffer.unused == "return" else None, admission=gate,
        )
        parts.progress = functools.partial(worker_progress, cfg, parts.worker, discarded)
    return parts


def worker_progress(cfg: VerstConfig, worker: AsyncRolloutWorker, discarded: collections.Counter[str]) -> str:
    """What the fully async worker made of its groups so far, for a trainer waiting on them: finished, dropped
    by reason (the setting that drops them named), generating."""
    reasons = {"filtered": f"by rollout.dynamic_filter = {cfg.rollout.dynamic_filter!r}",
               "aborted": "aborted (an error or an abort in a sample)",
               "stale": f"stale (over buffer.max_staleness = {cfg.buffer.max_staleness})"}
    dropped = ", ".join(f"{discarded[reason]} {text}" for reason, text in reasons.items() if discarded[reason])
    progress = worker.progress()
    return (f"{progress['groups_finished']} groups finished since the worker started, "
            f"{'dropped: ' + dropped if dropped else 'none dropped'}; "
            f"{progress['generating']} trajectories generating")


def admission_gate(cfg: VerstConfig) -> StalenessGate | None:
    """`rollout.admission` resolved: a staleness gate (staleness, or auto with buffer.max_staleness), or None."""
    staleness = cfg.buffer.max_staleness
    if cfg.rollout.admission == "fill" or staleness is None:
        return None
    return StalenessGate(batch_plan(cfg).groups_per_train_step, staleness, served_lag=cfg.sync.interval - 1)


def counted(on_discard: OnDiscard, gate: StalenessGate | None, discarded: collections.Counter[str]) -> OnDiscard:
    """`on_discard`, counting each discarded group by reason and telling the gate (when there is one)."""

    def count(group: Group, reason: DiscardReason) -> None:
        discarded[reason] += 1
        if gate is not None:
            gate.count_discard(reason)
        on_discard(group, reason)

    return count


def batch_metrics(groups: list[Group], key: str | None) -> dict[str, float]:
    """`rollout/` metrics of the groups a train step consumes (the fully async path's view)."""
    samples = [s for g in groups for s in g]
    return {**sample_metrics(samples, key), **prefix_cache_metrics(samples)}


def record_samples(run_dir: str, n_groups: int, steps_per_rollout: int | None, groups: list[Group],
                   rollout_id: int | None, version: int) -> None:
    """The samples of the first `n_groups` groups of a train batch, to the run's samples.jsonl, under the
    first train step that consumes them. With `steps_per_rollout` (one step off, where a batch is generated
    a step ahead), rollout step k feeds steps k * steps_per_rollout + 1 onwards; otherwise the batch is
    trained on at the step after `version` (sync: the version it was generated at; fully async: taken at)."""
    step = version + 1 if rollout_id is None or steps_per_rollout is None else rollout_id * steps_per_rollout + 1
    append_samples(run_dir, step, [s for g in groups[:n_groups] for s in g])


def prepare_rollout_parts(cfg: VerstConfig) -> None:
    """What `build_rollout_parts` can do before the engines are up: load the tokenizer, which imports
    transformers — seconds the actor otherwise spends after the engines are ready."""
    if cfg.model.kind != "diffusion":
        load_tokenizer(cfg.model.path)


def request_batch(cfg: VerstConfig, router_url: str | None) -> int:
    """Prompts per /generate request: batched straight to an engine; one at a time through sglang-router,
    which cannot forward SGLang's batch form (0.3 takes one rid per request)."""
    return cfg.rollout.request_batch if router_url is None else 1
