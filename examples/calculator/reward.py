"""The calculator task's reward: 1.0 when the agent's final answer (the last reply without a tool call,
`metadata['final_answer']`, set by examples/calculator/agent.py) equals the label numerically.

`reward.type = "custom"`, `reward.path = "examples.calculator.reward:final_answer"`.
"""

from __future__ import annotations

from decimal import Decimal, InvalidOperation

from verst.rewards import RewardError
from verst.rewards.builtin import labels_of, last_number
from verst.types import Sample

ANSWER_KEY = "final_answer"


async def final_answer(sample: Sample) -> float:
    """1.0 if the last number of the final answer equals a label; 0.0 for a wrong or missing answer."""
    if ANSWER_KEY not in sample.metadata:
        raise RewardError(f"sample {sample.index}: metadata has no {ANSWER_KEY!r} (keys {sorted(sample.metadata)}); "
                          "this reward needs the calculator agent (examples.calculator.agent:run)")
    answer = sample.metadata[ANSWER_KEY]
    if not answer:  # the episode ended without an answer (turn limit, context full, cut off)
        return 0.0
    predicted = last_number(answer)
    for label in labels_of(sample):
        try:
            gold = Decimal(label.strip())
        except InvalidOperation:
            raise RewardError(f"sample {sample.index}: label {label!r} is not a number") from None
        if predicted is not None and predicted == gold:
            return 1.0
    return 0.0
