"""Batch arithmetic: the numbers every schedule derives from the config, checked in one place."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verst.config.schema import VerstConfig


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    samples_per_rollout: int  # rollout.batch_size × n_samples_per_prompt
    global_batch_size: int  # samples per optimizer step
    groups_per_train_step: int
    train_steps_per_rollout: int
    total_train_steps: int
    samples_per_rank: int  # per optimizer step
    buffer_capacity_groups: int
    max_in_flight: int  # fully async: trajectories generating at once

    def describe(self) -> str:
        return "\n".join(f"  {f.name} = {getattr(self, f.name)}" for f in dataclasses.fields(self))


def batch_plan(cfg: VerstConfig) -> BatchPlan:
    r, t = cfg.rollout, cfg.trainer
    samples = r.batch_size * r.n_samples_per_prompt
    gbs = t.global_batch_size or samples
    steps_per_rollout = samples // gbs
    groups_per_step = gbs // r.n_samples_per_prompt
    return BatchPlan(
        samples_per_rollout=samples,
        global_batch_size=gbs,
        groups_per_train_step=groups_per_step,
        train_steps_per_rollout=steps_per_rollout,
        total_train_steps=steps_per_rollout * r.num_rollouts,
        samples_per_rank=gbs // cfg.cluster.trainer_ranks,
        buffer_capacity_groups=max(1, int(cfg.buffer.capacity_factor * groups_per_step)),
        max_in_flight=r.max_in_flight or samples,
    )


def check_batch_arithmetic(cfg: VerstConfig) -> None:
    """Raise ValueError with the numbers when the batch sizes do not divide as the loop needs."""
    r, t, c = cfg.rollout, cfg.trainer, cfg.cluster
    samples = r.batch_size * r.n_samples_per_prompt
    gbs = t.global_batch_size or samples
    if samples % gbs:
        raise ValueError(
            f"rollout.batch_size × rollout.n_samples_per_prompt = {r.batch_size} × {r.n_samples_per_prompt} = "
            f"{samples} samples per rollout is not divisible by trainer.global_batch_size = {gbs}"
        )
    if gbs % r.n_samples_per_prompt:
        raise ValueError(
            f"trainer.global_batch_size = {gbs} is not a multiple of rollout.n_samples_per_prompt = "
            f"{r.n_samples_per_prompt}: a train step consumes whole groups"
        )
    if gbs % c.trainer_ranks:
        raise ValueError(
            f"trainer.global_batch_size = {gbs} is not divisible by cluster.trainer_ranks = {c.trainer_ranks}"
        )
    if r.over_sampling_batch_size is not None and r.over_sampling_batch_size < r.batch_size:
        raise ValueError(
            f"rollout.over_sampling_batch_size = {r.over_sampling_batch_size} is smaller than "
            f"rollout.batch_size = {r.batch_size}"
        )
    if r.max_in_flight is not None and r.max_in_flight < r.n_samples_per_prompt:
        raise ValueError(
            f"rollout.max_in_flight = {r.max_in_flight} cannot hold one group of "
            f"rollout.n_samples_per_prompt = {r.n_samples_per_prompt}"
        )
    if r.max_context_tokens is not None and r.max_context_tokens <= r.max_response_tokens:
        raise ValueError(
            f"rollout.max_context_tokens = {r.max_context_tokens} leaves no room for a prompt with "
            f"rollout.max_response_tokens = {r.max_response_tokens}"
        )
