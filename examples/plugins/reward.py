"""Reward fns (`reward.type = "custom"`, `reward.path`): `async (sample) -> float | dict`, or with
`reward.group = true`, `async (samples of one group) -> list of float | dict`.

    [reward]
    type = "custom"
    path = "examples.plugins.reward:correct_and_short"
    key = "correct"          # a dict reward: the value the advantages use
"""

from __future__ import annotations

from verst.rewards.builtin import labels_of, last_number
from verst.types import Sample


async def correct_and_short(sample: Sample) -> dict[str, float]:
    """`correct`: the response's last number equals a label; `short`: 1 for a reply of at most 8 characters.
    Every value of a dict reward is logged as `rollout/reward/<name>`; `reward.key` picks the one trained on.
    A sample without a label raises RewardError (from `labels_of`): it is marked FAILED, never scored 0."""
    labels = labels_of(sample)
    answer = last_number(sample.response)
    correct = answer is not None and any(answer == last_number(label) for label in labels)
    return {"correct": float(correct), "short": float(len(sample.response.strip()) <= 8)}


async def first_correct_in_group(samples: list[Sample]) -> list[float]:
    """A group reward (`reward.group = true`): 1.0 for the shortest correct response of the group only."""
    scores = [await correct_and_short(s) for s in samples]
    correct = [i for i, score in enumerate(scores) if score["correct"]]
    best = min(correct, key=lambda i: len(samples[i].response), default=None)
    return [1.0 if i == best else 0.0 for i in range(len(samples))]
