"""Loss plug-ins the contract tests load by import path; each records its call so a test can see it ran."""

from __future__ import annotations

import torch

from verst.algo import aggregate

CALLS: list[tuple[str, dict]] = []


def half_weights(old_logprobs, rollout_logprobs, loss_mask, *, clip_low, clip_high):
    CALLS.append(("mismatch_fn", {"shape": tuple(loss_mask.shape), "clip_low": clip_low, "clip_high": clip_high}))
    return torch.full_like(old_logprobs, 0.5), torch.zeros_like(loss_mask, dtype=torch.bool)


def reinforce(logprobs, old_logprobs, advantages, loss_mask, cfg):
    CALLS.append(("policy_loss_fn", {"shape": tuple(loss_mask.shape), "eps_clip": cfg.eps_clip}))
    return -advantages * logprobs, torch.zeros_like(loss_mask, dtype=torch.bool)


def doubled_mean(token_values, loss_mask, aggregation):
    CALLS.append(("loss_reducer", {"aggregation": aggregation}))
    return 2.0 * aggregate(token_values, loss_mask, aggregation)


class NotAFunction:
    def __init__(self, token_values, loss_mask, aggregation): ...


async def async_reducer(token_values, loss_mask, aggregation): ...


def two_args(token_values, loss_mask): ...
