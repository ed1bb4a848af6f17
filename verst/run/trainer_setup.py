"""Steps every recipe shares: start the trainer ranks, copy trainer weights into a local model."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

from verst.config import VerstConfig
from verst.config.devices import on_cuda
from verst.models.loader import load_full_state_dict
from verst.run.cores import trainer_alone
from verst.trainer import TrainBackend, fsdp2_backend
from verst.types import WeightBucket
from verst.types.cores import share_taken


@contextlib.contextmanager
def open_trainer(cfg: VerstConfig, total_steps: int, temperature: float = 1.0,
                 ref_model_path: str | None = None, critic: bool = False) -> Iterator[TrainBackend]:
    """One rank in this process, or rank actors on Ray (the orchestration's launcher: a local Ray on
    127.0.0.1 unless `cluster.ray_address`, placed for the trainer only) when there are several ranks or the
    run names a cluster or node resources to place them on.

    `temperature` must be the sampling temperature in RL, so recomputed logprobs match the engine's. With
    `critic` the backend holds PPO's value model too (`cfg.critic`). On CPU the ranks split the run's cores
    (`cluster.cores`, `cluster.trainer_threads`): the trainer runs alone.
    """
    factory = functools.partial(fsdp2_backend, cfg.model, cfg.trainer, total_steps=total_steps,
                                temperature=temperature, ref_model_path=ref_model_path, lora=cfg.lora,
                                critic=cfg.critic if critic else None)
    if cfg.cluster.trainer_ranks == 1 and not cfg.cluster.ray_address and not cfg.cluster.trainer_resources:
        shares = trainer_alone(cfg, "cuda" if on_cuda(cfg.cluster.device) else "cpu")
        # the trainer alone on every core of the run; this process's threads as they were afterwards
        with share_taken(shares[0]) if shares else contextlib.nullcontext():
            yield factory(device=cfg.cluster.device)
        return
    from verst.orchestration import Orchestration

    with Orchestration(cfg.cluster, engines=False) as orch:
        shares = trainer_alone(cfg, orch.device)
        yield orch.start_trainer(functools.partial(factory, device=orch.device),
                                 shares=list(shares) if shares else None)


def load_weights_into(model: Any, buckets: Iterator[WeightBucket]) -> None:
    """Copy full trainer weights into a plain HF model; only tied weights may be absent."""
    state = {name: tensor for bucket in buckets for name, tensor in bucket}
    load_full_state_dict(model, state, "trainer weights", error=RuntimeError)
