"""A generate fn (`rollout.generate_fn`): `async (ctx, sample) -> Sample` fills one sample's tokens,
masks, logprobs, status, weight version and response text. This one needs no engine: it answers every
prompt with its label, which checks a task's data, chat template and reward end to end (every reward
should be 1.0) before any model is involved.

    [rollout]
    generate_fn = "examples.plugins.generate:oracle"
"""

from __future__ import annotations

from verst.rollout.generate import prompt_ids_of
from verst.rollout.plugins import RolloutContext
from verst.types import Sample, Status


async def oracle(ctx: RolloutContext, sample: Sample) -> Sample:
    prompt_ids = prompt_ids_of(ctx, sample)  # the ids the default generate fn would send to an engine
    answer = str(sample.label)
    response_ids = ctx.tokenizer.encode(answer, add_special_tokens=False)
    sample.tokens = prompt_ids + response_ids
    sample.response_length = len(response_ids)
    sample.loss_mask = [1] * len(response_ids)  # 1: a token the policy "sampled"
    sample.rollout_logprobs = [0.0] * len(response_ids)  # log 1: the oracle is certain
    sample.weight_versions.append("0")  # one entry per engine call; staleness is measured from it
    sample.response = answer
    sample.status = Status.COMPLETED
    return sample
