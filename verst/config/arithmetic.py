"""Batch arithmetic: the numbers every schedule derives from the config (the rules that they divide as the
loop needs are in `rules`)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

from verst.config.inputs import RolloutConfig
from verst.config.runtime import BufferConfig, ClusterConfig
from verst.config.training import TrainerConfig


class Sized(Protocol):
    """The sections the batch plan reads (a `VerstConfig`)."""

    rollout: RolloutConfig
    trainer: TrainerConfig
    cluster: ClusterConfig
    buffer: BufferConfig


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


def batch_plan(cfg: Sized) -> BatchPlan:
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
