"""Names of your own in verst's registries: an advantage estimator and a reward, registered when this module
is imported. The config's `plugins` lists it, so every process of the run (the driver, the trainer ranks,
the rollout manager) imports it first, and the names are then valid values of the fields that take one.

    plugins = ["examples.plugins.registered"]

    [algorithm]
    advantage_estimator = "median_baseline"

    [reward]
    type = "answer_then_stop"
"""

from __future__ import annotations

import torch

from verst.algo import broadcast_to_tokens, register_advantage_estimator
from verst.rewards import register_reward
from verst.rewards.builtin import labels_of, last_number
from verst.types import Sample


@register_advantage_estimator("median_baseline", doc="r − the group's median reward, on every policy token")
def median_baseline(cfg, rewards, group_ids, loss_mask, *, kl=None, values=None):
    """A baseline a single outlier in the group cannot move (GRPO's mean can)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    group_ids = torch.as_tensor(group_ids)
    baseline = torch.empty_like(rewards)
    for group in group_ids.unique():
        members = group_ids == group
        baseline[members] = rewards[members].median()
    return broadcast_to_tokens(rewards - baseline, loss_mask), None


@register_reward("answer_then_stop", doc="1 for the right number as the whole reply, 0.5 for it followed by more")
async def answer_then_stop(sample: Sample) -> float:
    """The label's number alone scores 1; the right last number with other text around it 0.5."""
    reply = sample.response.strip()
    if reply in [label.strip() for label in labels_of(sample)]:
        return 1.0
    number = last_number(reply)
    return 0.5 if number is not None and str(number) in labels_of(sample) else 0.0
