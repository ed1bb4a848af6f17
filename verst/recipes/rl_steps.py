"""The named RL steps every schedule calls: turn finished groups into a train batch (old and
reference logprobs, advantages), run one optimizer step with the configured loss.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Sequence

import torch

from verst.algo import aggregation_normalizer, compute_advantages, rl_loss
from verst.config import AlgorithmConfig, VerstConfig
from verst.trainer import ROLLOUT_LOGPROBS, ForwardOutputs, MicroBatch, TrainBackend, make_items
from verst.types import Group, Sample


def rl_loss_fn(
    algo: AlgorithmConfig, outputs: ForwardOutputs, batch: MicroBatch, normalizer: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The backend's loss fn for RL: `algo.rl_loss` over one micro-batch (picklable via partial)."""
    extras = batch.extras
    return rl_loss(
        algo, outputs.logprobs, batch["old_logprobs"], batch["advantages"], batch.loss_mask,
        rollout_logprobs=extras.get(ROLLOUT_LOGPROBS), ref_logprobs=extras.get("ref_logprobs"),
        entropy=outputs.entropy, normalizer=normalizer,
    )


def _pad(rows: Sequence[Sequence[float]] | Sequence[torch.Tensor]) -> torch.Tensor:
    width = max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), width)  # [batch, max_resp]
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def train_on_groups(trainer: TrainBackend, groups: Sequence[Group], cfg: VerstConfig) -> dict[str, float]:
    """One optimizer step on whole groups: logprobs (old, reference) → advantages → loss → step."""
    algo = cfg.algorithm
    samples: list[Sample] = [s for g in groups for s in g]
    start = time.perf_counter()
    extras: dict[str, list] = {}
    if algo.use_rollout_logprobs:
        old = [torch.tensor(s.rollout_logprobs) for s in samples]
    else:
        old = trainer.logprobs(samples)
    extras["old_logprobs"] = old
    ref = trainer.logprobs(samples, reference=True) if algo.kl_loss_coef > 0 or algo.kl_penalty_coef > 0 else None
    if ref is not None:
        extras["ref_logprobs"] = ref
    logprob_s = time.perf_counter() - start
    mask = _pad([s.loss_mask for s in samples])  # [batch, max_resp]
    rewards = torch.tensor([s.reward_value(cfg.reward.key) for s in samples])
    group_ids = torch.tensor([s.group_index for s in samples])
    advantages, _ = compute_advantages(
        algo, rewards, group_ids, mask, logprobs=_pad(old), ref_logprobs=_pad(ref) if ref is not None else None
    )
    extras["advantages"] = [advantages[i, : s.response_length] for i, s in enumerate(samples)]
    items = make_items(samples, **extras)
    normalizer = functools.partial(aggregation_normalizer, algo.loss_aggregation)
    metrics = trainer.train_step(
        items, functools.partial(rl_loss_fn, algo), normalizer=normalizer, with_entropy=algo.entropy_coef > 0
    )
    metrics["time/logprob_s"] = logprob_s
    metrics["time/train_s"] = time.perf_counter() - start
    metrics["train/advantage_abs_mean"] = float((advantages.abs() * mask).sum() / mask.sum().clamp(min=1))
    return metrics
