"""What the trainer trains on: a `TrainItem` is one sequence plus its per-token training tensors.

Built from a `Sample` and the extras the caller computed for it (advantages, old/ref logprobs).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

from verst.types import Sample
from verst.types.arrays import decode_array

# The extra every item built from a Sample carries: the engine's logprobs of the response tokens.
ROLLOUT_LOGPROBS = "rollout_logprobs"


class TrainItemError(ValueError):
    """A TrainItem broke a length or value invariant; the message names the item and the values."""


@dataclasses.dataclass
class TrainItem:
    """One sequence to train on: prompt + response ids and response-aligned per-token tensors.

    `extras` maps a name ("advantages", "old_logprobs", "ref_logprobs", ...) to per-token values
    of length `response_length` (tensor or list; a scalar is broadcast to every token), stored as
    float32; the loss fn reads them as `batch[name]`, padded to `[mb, resp_len]`.
    `index` is the item's position in the caller's list (results come back in that order).
    `routed_experts`: MoE, the engine's expert choices for every token but the last (the sample's
    `routed_experts`), which routing replay feeds to the trainer's routers.
    `latents`: an image trajectory's recorded latents (the sample's `latents`, decoded), `[response_length + 1,
    C, H, W]` float32: one per denoising step and the start noise (the diffusion backend's input).
    """

    tokens: torch.Tensor  # [len] int64: prompt + response ids
    response_length: int
    loss_mask: torch.Tensor  # [response_length] float32: 1 on policy tokens, 0 on env/tool tokens
    extras: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # each [response_length]
    index: int = 0
    routed_experts: torch.Tensor | None = None  # [len - 1, moe_layers, top_k] int64
    latents: torch.Tensor | None = None  # [response_length + 1, C, H, W] float32

    def __post_init__(self) -> None:
        self.tokens = torch.as_tensor(self.tokens, dtype=torch.long)
        if self.routed_experts is not None:
            self.routed_experts = torch.as_tensor(self.routed_experts, dtype=torch.long)
        self.loss_mask = torch.as_tensor(self.loss_mask, dtype=torch.float32)
        self.extras = {k: _per_token(self.index, k, v, self.response_length) for k, v in self.extras.items()}
        self.validate()

    @property
    def length(self) -> int:
        return int(self.tokens.numel())

    @property
    def prompt_length(self) -> int:
        return self.length - self.response_length

    def validate(self) -> TrainItem:
        where = f"train item {self.index}"
        if self.tokens.dim() != 1:
            raise TrainItemError(f"{where}: tokens must be 1-D, got shape {tuple(self.tokens.shape)}")
        if not 0 <= self.response_length < self.length:
            raise TrainItemError(
                f"{where}: response_length {self.response_length} outside [0, len(tokens)={self.length}) "
                "(a sequence needs at least one prompt token)"
            )
        if self.loss_mask.shape != (self.response_length,):
            raise TrainItemError(
                f"{where}: loss_mask has shape {tuple(self.loss_mask.shape)}, expected ({self.response_length},)"
            )
        if self.latents is not None and (self.latents.dim() < 2 or self.latents.shape[0] != self.response_length + 1):
            raise TrainItemError(f"{where}: latents have shape {tuple(self.latents.shape)}, expected "
                                 f"({self.response_length + 1}, ...): one per denoising step and the start noise")
        experts = self.routed_experts
        if experts is not None and (experts.dim() != 3 or experts.shape[0] != self.length - 1):
            raise TrainItemError(f"{where}: routed_experts has shape {tuple(experts.shape)}, expected "
                                 f"({self.length - 1}, moe_layers, top_k): one row per token but the last")
        return self

    @classmethod
    def from_sample(cls, sample: Sample, index: int, **extras: Any) -> TrainItem:
        """An item from a Sample; `extras` values are per-token arrays or scalars (broadcast)."""
        merged = {ROLLOUT_LOGPROBS: sample.rollout_logprobs, **extras}
        latents = None if sample.latents is None else torch.from_numpy(decode_array(sample.latents, "latents"))
        return cls(sample.tokens, sample.response_length, sample.loss_mask, merged, index, sample.routed_experts,
                   latents)


def make_items(samples: Sequence[Sample], **extras: Sequence[Any]) -> list[TrainItem]:
    """Items from samples plus, per extra name, one value per sample (per-token array or scalar).

    >>> make_items(samples, advantages=[0.5, -0.5], old_logprobs=[lp0, lp1])
    """
    for name, values in extras.items():
        if len(values) != len(samples):
            raise TrainItemError(f"extra {name!r} has {len(values)} values for {len(samples)} samples")
    return [
        TrainItem.from_sample(s, i, **{name: values[i] for name, values in extras.items()})
        for i, s in enumerate(samples)
    ]


def as_items(batch: Sequence[TrainItem | Sample]) -> list[TrainItem]:
    """Accept items or plain samples; number them by position so results come back in order."""
    if not batch:
        raise TrainItemError("the batch is empty")
    items = []
    for i, x in enumerate(batch):
        if isinstance(x, Sample):
            items.append(TrainItem.from_sample(x, i))
        elif isinstance(x, TrainItem):
            items.append(x if x.index == i else dataclasses.replace(x, index=i))
        else:
            raise TrainItemError(f"batch element {i} is a {type(x).__name__}, expected TrainItem or Sample")
    names = set(items[0].extras)
    for item in items:
        if set(item.extras) != names:
            raise TrainItemError(
                f"train item {item.index} has extras {sorted(item.extras)}, item 0 has {sorted(names)}; "
                "every item of a batch must carry the same extras"
            )
    return items


def _per_token(index: int, name: str, value: Any, n: int) -> torch.Tensor:
    if isinstance(value, (int, float)):
        return torch.full((n,), float(value), dtype=torch.float32)
    tensor = torch.as_tensor(value, dtype=torch.float32)
    if tensor.shape != (n,):
        raise TrainItemError(
            f"train item {index}: extra {name!r} has shape {tuple(tensor.shape)}, expected ({n},) "
            "(one value per response token) or a scalar"
        )
    return tensor
