"""The coding environment's reward: the fraction of the task's hidden checks (without checks, of its tests) that
pass in the workspace at the episode's end (`metadata['pass_fraction']`, set by examples/coding/agent.py).

`reward.type = "custom"`, `reward.path = "examples.coding.reward:pass_fraction"`.
"""

from __future__ import annotations

from verst.rewards import RewardError
from verst.types import Sample

KEY = "pass_fraction"


async def pass_fraction(sample: Sample) -> float:
    if KEY not in sample.metadata:
        raise RewardError(f"sample {sample.index}: metadata has no {KEY!r} (keys {sorted(sample.metadata)}); "
                          "this reward needs the coding agent (examples.coding.agent:run)")
    return float(sample.metadata[KEY])
