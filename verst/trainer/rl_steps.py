"""The named RL steps every schedule calls: the old policy's logprobs of a rollout batch, then per
optimizer step a train batch (reference logprobs, critic values, advantages) and one step with the
configured loss, followed with PPO by one step of the critic on the GAE returns.

The old policy is the one that existed before the rollout batch's first optimizer step: its logprobs
are recomputed once per rollout batch (every later step of the batch then sees a real importance
ratio and PPO's clip), taken from the engine, or (`auto`, one step per batch) read off the train
step's own forward pass, detached, which is the same number without a second pass.

In an RL run each trainer rank calls `train_rollout_step` on its own backend (`RLRun.train` passes the
function; Ray pickles it by reference) and keeps the rollout batch, with its old logprobs, between the
batch's steps; the steps also run against an in-process backend, as the component tests do. torch is
imported inside the functions: the driver imports this module, and no torch.
"""

from __future__ import annotations

import dataclasses
import functools
import time
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

from verst.config import AlgorithmConfig, VerstConfig, batch_plan
from verst.trainer.backend import TrainBackend
from verst.types import Group, Sample

if TYPE_CHECKING:
    import torch

    from verst.trainer import ForwardOutputs, MicroBatch

TOKEN_STALENESS = "token_staleness"  # the train items' extra: trainer version minus each token's version
# Per sample of a rollout batch ([response_length] each); None: each step's own forward.
OldLogprobs = Sequence["torch.Tensor"] | None


def old_logprob_source(cfg: VerstConfig) -> str:
    """`algorithm.old_logprobs` resolved: "recompute", "rollout" or "forward" (the train step's own
    detached forward). `auto` is "forward" only where it is exact: every rollout batch gets one
    optimizer step (so the old policy is the current one), no KL penalty needs the old logprobs
    before the step, and no LoRA dropout makes the training forward differ from the policy's; else
    "recompute"."""
    algo = cfg.algorithm
    if algo.old_logprobs != "auto":
        return algo.old_logprobs
    one_step = batch_plan(cfg).train_steps_per_rollout == 1 or cfg.schedule == "fully_async"
    exact = one_step and algo.kl_penalty_coef == 0 and not (cfg.lora.enabled and cfg.lora.dropout > 0)
    return "forward" if exact else "recompute"


def old_logprobs(trainer: TrainBackend, groups: Sequence[Group], cfg: VerstConfig) -> OldLogprobs:
    """The old policy's logprobs of every sample of a rollout batch, in order; call it before the
    batch's first optimizer step. None when each step reads them off its own forward pass."""
    import torch

    samples = [s for g in groups for s in g]
    source = old_logprob_source(cfg)
    if source == "rollout":
        return [torch.tensor(s.rollout_logprobs, dtype=torch.float32) for s in samples]
    if source == "recompute":
        return trainer.logprobs(samples)
    return None


def rl_loss_fn(
    algo: AlgorithmConfig, old_from_forward: bool, outputs: ForwardOutputs, batch: MicroBatch, normalizer: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The backend's loss fn for RL: `algo.rl_loss` over one micro-batch (picklable via partial). The old
    logprobs are the batch's `old_logprobs`, or with `old_from_forward` this forward's own, detached."""
    from verst.algo import rl_loss
    from verst.trainer import ROLLOUT_LOGPROBS

    extras = batch.extras
    old = outputs.logprobs.detach() if old_from_forward else batch["old_logprobs"]
    return rl_loss(
        algo, outputs.logprobs, old, batch["advantages"], batch.loss_mask,
        rollout_logprobs=extras.get(ROLLOUT_LOGPROBS), ref_logprobs=extras.get("ref_logprobs"),
        teacher_logprobs=extras.get("teacher_logprobs"), token_staleness=extras.get(TOKEN_STALENESS),
        entropy=outputs.entropy, normalizer=normalizer,
    )


def value_loss_fn(
    algo: AlgorithmConfig, outputs: ForwardOutputs, batch: MicroBatch, normalizer: float
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's loss fn: PPO's clipped value loss (`algo.value_clip`) of its values against the batch's
    `returns`, clipped around `old_values` (the critic's before this step), reduced like the policy loss."""
    from verst.algo import value_loss

    return value_loss(outputs.values, batch["old_values"], batch["returns"], batch.loss_mask,
                      value_clip=algo.value_clip, aggregation=algo.loss_aggregation, normalizer=normalizer)


def _pad(rows: Sequence[Sequence[float]] | Sequence[torch.Tensor]) -> torch.Tensor:
    import torch

    width = max((len(r) for r in rows), default=0)
    out = torch.zeros(len(rows), width)  # [batch, max_resp]
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.as_tensor(r, dtype=torch.float32)
    return out


def train_on_groups(
    trainer: TrainBackend, groups: Sequence[Group], cfg: VerstConfig, old: OldLogprobs = None,
    values: Sequence[torch.Tensor] | None = None, version: int | None = None,
) -> dict[str, float]:
    """One optimizer step on whole groups: reference logprobs → advantages → loss → step. `old` are the
    groups' old-policy logprobs from `old_logprobs` (computed here when None and the source is not the
    step's own forward: a batch that gets one step). With PPO, `values` are the critic's from before the
    rollout batch's first step (computed here when None), and the critic takes its step after the policy's.
    `version` is the trainer's weight version before the step: each token's staleness is measured from it
    (`algorithm.max_token_staleness` needs it)."""
    import torch

    from verst.algo import aggregation_normalizer, compute_advantages, ess_ratio_from_moments
    from verst.trainer import make_items

    algo = cfg.algorithm
    samples: list[Sample] = [s for g in groups for s in g]
    start = time.perf_counter()
    from_forward = old_logprob_source(cfg) == "forward"
    if old is None and not from_forward:
        old = old_logprobs(trainer, groups, cfg)
    if old is not None and len(old) != len(samples):
        raise ValueError(f"train_on_groups: {len(old)} old logprob rows for {len(samples)} samples")
    extras: dict[str, list] = {} if old is None else {"old_logprobs": old}
    ref = trainer.logprobs(samples, reference=True) if algo.needs_reference else None
    if ref is not None:
        extras["ref_logprobs"] = ref
    if algo.needs_critic and values is None:
        values = trainer.values(samples)
    logprob_s = time.perf_counter() - start
    mask = _pad([s.loss_mask for s in samples])  # [batch, max_resp]
    rewards = torch.tensor([s.reward_value(cfg.reward.key) for s in samples])
    group_ids = torch.tensor([s.group_index for s in samples])
    advantages, returns = compute_advantages(
        algo, rewards, group_ids, mask, logprobs=_pad(old) if old is not None else None,
        ref_logprobs=_pad(ref) if ref is not None else None, values=_pad(values) if values is not None else None,
    )
    extras["advantages"] = [advantages[i, : s.response_length] for i, s in enumerate(samples)]
    if algo.distill_coef > 0:
        extras["teacher_logprobs"] = teacher_logprobs(samples)
    if version is not None:
        extras[TOKEN_STALENESS] = token_staleness(samples, version)
    elif algo.max_token_staleness is not None:
        raise ValueError(f"algorithm.max_token_staleness = {algo.max_token_staleness}: train_on_groups needs the "
                         "trainer's version to measure each token's staleness from; none was given")
    items = make_items(samples, **extras)
    normalizer = functools.partial(aggregation_normalizer, algo.loss_aggregation)
    metrics = trainer.train_step(
        items, functools.partial(rl_loss_fn, algo, from_forward), normalizer=normalizer,
        with_entropy=algo.entropy_coef > 0,
    )
    if values is not None:
        metrics.update(train_critic(trainer, samples, values, returns, mask, algo))
    if "train/mismatch_ratio_sq_mean" in metrics:  # the moments add up over micro-batches and ranks; ESS does not
        metrics["train/ess_ratio"] = ess_ratio_from_moments(
            metrics["train/mismatch_ratio_mean"], metrics["train/mismatch_ratio_sq_mean"]
        )
    metrics["time/logprob_s"] = logprob_s
    metrics["time/train_s"] = time.perf_counter() - start
    metrics["train/advantage_abs_mean"] = float((advantages.abs() * mask).sum() / mask.sum().clamp(min=1))
    return metrics


def teacher_logprobs(samples: Sequence[Sample]) -> list[list[float]]:
    """Every sample's teacher logprobs (on-policy distillation); a sample the teacher did not score fails
    the step by name, as training it on the task reward alone would be a silent change of objective."""
    missing = [s.index for s in samples if s.teacher_logprobs is None]
    if missing:
        raise ValueError(f"algorithm.distill_coef > 0, but samples {missing[:8]} (of {len(samples)}) carry no "
                         "teacher_logprobs: the rollout fn must return samples the teacher scored")
    return [s.teacher_logprobs for s in samples]


def token_staleness(samples: Sequence[Sample], version: int) -> list[list[int]]:
    """Per sample, the trainer's `version` minus the version that sampled each response token: the sample's
    `token_versions`, else its oldest weight version on every token (as `buffer.max_staleness` counts it), else
    (no engine call recorded one) 0."""
    rows = []
    for s in samples:
        if s.token_versions is not None:
            rows.append([version - v for v in s.token_versions])
            continue
        oldest = s.oldest_weight_version()
        rows.append([0 if oldest is None else version - oldest] * s.response_length)
    return rows


def train_critic(
    trainer: TrainBackend, samples: Sequence[Sample], values: Sequence[torch.Tensor], returns: torch.Tensor,
    mask: torch.Tensor, algo: AlgorithmConfig,
) -> dict[str, float]:
    """One optimizer step of PPO's critic towards the GAE `returns` [batch, max_resp] of `samples`, whose
    `values` it gave before the step; its loss metrics, `train/value_mean` and `train/explained_variance`."""
    from verst.algo import aggregation_normalizer, explained_variance
    from verst.trainer import make_items

    items = make_items(samples, old_values=values,
                       returns=[returns[i, : s.response_length] for i, s in enumerate(samples)])
    metrics = trainer.train_critic(items, functools.partial(value_loss_fn, algo),
                                   normalizer=functools.partial(aggregation_normalizer, algo.loss_aggregation))
    padded = _pad(values)
    metrics["train/value_mean"] = float((padded * mask).sum() / mask.sum().clamp(min=1))
    explained = explained_variance(padded, returns, mask)
    if explained is not None:
        metrics["train/explained_variance"] = explained
    return metrics


@dataclasses.dataclass
class _KeptBatch:
    groups: list[Group]
    old: OldLogprobs  # the whole batch's, when it gets several steps; else None (each step takes its own)
    values: Sequence[torch.Tensor] | None = None  # the critic's, on the same terms (PPO)


# The rollout batch each backend is training on, kept between its optimizer steps: in an RL run each
# rank holds its own, so the groups arrive once and the old logprobs never leave the rank.
_kept: weakref.WeakKeyDictionary[TrainBackend, _KeptBatch] = weakref.WeakKeyDictionary()


def train_rollout_step(
    trainer: TrainBackend, batch: Sequence[Group] | None, first: int, cfg: VerstConfig, version: int | None = None
) -> dict[str, float]:
    """One optimizer step, from trainer version `version`, on groups [first, first + groups_per_train_step) of
    a rollout batch. Its first
    step passes the `batch`, kept here for the later ones (which pass None) with, when it gets more than
    one step, the old policy's logprobs (and with PPO the critic's values) taken now, before the first:
    PPO's value clip then bounds the critic's move over the whole batch."""
    per_step, start = batch_plan(cfg).groups_per_train_step, time.perf_counter()
    if batch is not None:
        groups = list(batch)
        several = len(groups) > per_step
        values = trainer.values([s for g in groups for s in g]) if several and cfg.algorithm.needs_critic else None
        _kept[trainer] = _KeptBatch(groups, old_logprobs(trainer, groups, cfg) if several else None, values)
    kept = _kept.get(trainer)
    if kept is None:
        raise RuntimeError(f"train_rollout_step: no rollout batch kept for the step at group {first}; "
                           "the batch's first step passes it")
    old_s = time.perf_counter() - start
    step_groups = kept.groups[first : first + per_step]
    offset = sum(len(g) for g in kept.groups[:first])
    rows = slice(offset, offset + sum(len(g) for g in step_groups))
    metrics = train_on_groups(trainer, step_groups, cfg, None if kept.old is None else kept.old[rows],
                              None if kept.values is None else kept.values[rows], version)
    metrics["time/logprob_s"] += old_s
    if first + per_step >= len(kept.groups):
        del _kept[trainer]  # the batch's last step
    return metrics


def use_adapter(trainer: TrainBackend, adapter: str) -> None:
    """Multi-LoRA: make `adapter` the one the trainer's next forwards, steps and weight pushes use."""
    trainer.use_adapter(adapter)  # type: ignore[attr-defined]


def train_adapter_step(
    trainer: TrainBackend, adapter: str, batch: Sequence[Group] | None, first: int, cfg: VerstConfig,
    version: int | None = None,
) -> dict[str, float]:
    """Multi-LoRA: `train_rollout_step` with `adapter` active; `cfg` is that adapter's run config (its
    reward key, batch plan, algorithm). Its rollout batch's steps run back to back, so the kept batch is its."""
    use_adapter(trainer, adapter)
    return train_rollout_step(trainer, batch, first, cfg, version)
