"""The loss-fn contract of the train backends, the built-in SFT loss, and global normalisers.

A loss fn is algorithm code; the backend only calls it once per micro-batch and sums the results.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch

from verst.algo.aggregation import aggregation_normalizer
from verst.algo.losses import sft_loss
from verst.trainer.batching import ForwardOutputs, MicroBatch


class LossFn(Protocol):
    """`loss_fn(outputs, batch, normalizer) -> (loss, metrics)`, called once per micro-batch.

    `normalizer` is the global count (tokens or sequences of the whole global batch, all ranks and
    micro-batches, as computed by the step's `Normalizer`); dividing this micro-batch's loss sum by
    it makes the micro-batch losses add up to the global-batch loss. `metrics` are plain means over
    this micro-batch (floats or 0-d tensors); the backend averages them over the global batch,
    weighting each micro-batch by its share of the normaliser, except keys ending in `_max` or
    `_min`, which combine by max or min (`combine_metric`). Must be picklable (a module-level
    function or a functools.partial of one) to cross into rank processes.
    """

    def __call__(
        self, outputs: ForwardOutputs, batch: MicroBatch, normalizer: float
    ) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]: ...


class Normalizer(Protocol):
    """`normalizer(loss_mask [batch, resp_len]) -> count`: this batch's share of the global count."""

    def __call__(self, loss_mask: torch.Tensor) -> float: ...


def combine_metric(totals: dict[str, float], key: str, value: float, weight: float) -> None:
    """Fold one micro-batch's (or rank's) metric into `totals`: `*_max` by max, `*_min` by min, any
    other key as `weight × value` added to the sum (a weighted mean over the global batch)."""
    if key.endswith("_max"):
        totals[key] = max(totals[key], value) if key in totals else value
    elif key.endswith("_min"):
        totals[key] = min(totals[key], value) if key in totals else value
    else:
        totals[key] = totals.get(key, 0.0) + value * weight


def train_namespaced(metrics: dict[str, float]) -> dict[str, float]:
    """A loss fn's metrics under `train/` (a key that names its namespace keeps it)."""
    return {key if "/" in key else f"train/{key}": value for key, value in metrics.items()}


# The two global counts, as `Normalizer`s (picklable partials of the algo package's definition).
count_policy_tokens = functools.partial(aggregation_normalizer, "token_mean")  # policy tokens
count_policy_sequences = functools.partial(aggregation_normalizer, "seq_mean_token_mean")  # sequences with a policy token


def sft_loss_fn(
    outputs: ForwardOutputs, batch: MicroBatch, normalizer: float
) -> tuple[torch.Tensor, dict[str, float | torch.Tensor]]:
    """Masked negative log-likelihood, token-mean over the global batch (use `count_policy_tokens`)."""
    return sft_loss(outputs.logprobs, batch.loss_mask, aggregation="token_mean", normalizer=normalizer)
