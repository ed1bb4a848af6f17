"""Partial rollouts in the default generate fn against a scripted engine client (the HTTP edge): a call a
weight update aborted goes on from its last token with the new weights, keeping the ids and logprobs already
sampled and recording each token's version; other aborts, stopped samples and the switch off end it as
before. The real engine across a real pause is in tests/component/test_rollout_engine.py."""

import asyncio

import pytest

from verst.config import RolloutConfig, SamplingConfig
from verst.inference_client.client import GenerateResult
from verst.inference_client.protocol import SGLANG_ABORT, WEIGHT_UPDATE_ABORT
from verst.models.chat_template import TINY_CHAT_TEMPLATE
from verst.models.loader import load_tokenizer
from verst.models.prompts import encode_prompt
from verst.models.tokenizer import save_tokenizer
from verst.rollout.generate import CONTINUED_KEY, generate, generate_samples
from verst.rollout.plugins import RolloutContext
from verst.rollout.worker import GENERATE_ERROR_KEY
from verst.types import Sample, Status


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok"), TINY_CHAT_TEMPLATE))


class UpdatedEngine:
    """Replies in turn with each of `replies`: (output ids, logprobs, finish, weight version, abort message,
    oldest version); records every request. `during` runs while the first call is in flight."""

    def __init__(self, replies, during=None):
        self.replies, self.during, self.requests = list(replies), during, []

    async def generate(self, input_ids, sampling_params, *, rid=None, return_logprob=True):
        return (await self.generate_samples(input_ids, sampling_params, 1, rid=rid, record_n=False))[0]

    async def generate_samples(self, input_ids, sampling_params, n, *, rid=None, return_logprob=True, record_n=True):
        """One request of n samples (`rollout.request_per = "group"`): the next n replies, sample i as `{rid}_{i}`."""
        self.requests.append({"input_ids": list(input_ids), "params": dict(sampling_params), "rid": rid}
                             | ({"n": n} if record_n else {}))
        if self.during is not None and len(self.requests) == 1:
            self.during()
        await asyncio.sleep(0)
        return [self._reply(input_ids, rid if not record_n else f"{rid}_{i}") for i in range(n)]

    def _reply(self, input_ids, rid):
        output, logprobs, finish, version, message, oldest = self.replies.pop(0)
        meta = {"id": rid, "finish_reason": {"type": finish} | ({"message": message} if message else {}),
                "prompt_tokens": len(input_ids), "completion_tokens": len(output), "cached_tokens": 0,
                "weight_version": version, "oldest_weight_version": oldest or version,
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, output)]}
        return GenerateResult.from_reply({"text": "", "output_ids": list(output), "meta_info": meta})

    async def abort(self, rid):
        pass


def context(tokenizer, engine, **rollout):
    sampling = SamplingConfig(temperature=0.7, stop_token_ids=[258], seed=100)
    return RolloutContext(engine=engine, tokenizer=tokenizer,
                          rollout=RolloutConfig(sampling=sampling, max_response_tokens=10, **rollout))


FIRST = ([72, 105, 33], [-0.5, -1.25, -0.75])  # sampled by version 3 before the update aborted the call
REST = ([44, 258], [-2.0, -0.125])  # sampled by version 4, ending at the stop token


def test_a_call_a_weight_update_aborted_goes_on_from_its_last_token_with_the_new_weights(tokenizer):
    engine = UpdatedEngine([(*FIRST, "abort", "3", WEIGHT_UPDATE_ABORT, None), (*REST, "stop", "4", None, None)])
    ctx = context(tokenizer, engine, partial_rollout=True)
    out = asyncio.run(generate(ctx, Sample(prompt="What is 2+3?", index=5)))
    prompt = encode_prompt(tokenizer, "What is 2+3?")
    first, second = engine.requests
    assert first["input_ids"] == prompt and first["params"]["max_new_tokens"] == 10
    # token-in-token-out: the continuation's prompt is the prompt and the output so far, its budget what is left
    assert second["input_ids"] == prompt + [72, 105, 33] and second["params"]["max_new_tokens"] == 7
    assert second["params"]["sampling_seed"] == first["params"]["sampling_seed"] == 105
    assert first["rid"] != second["rid"] and ctx.state.in_flight == {}
    assert out.tokens == prompt + [72, 105, 33, 44, 258] and out.response_length == 5
    assert out.rollout_logprobs == [-0.5, -1.25, -0.75, -2.0, -0.125] and out.loss_mask == [1] * 5
    assert out.token_versions == [3, 3, 3, 4, 4] and out.weight_versions == ["3", "4"]
    assert out.status is Status.COMPLETED and GENERATE_ERROR_KEY not in out.metadata
    assert out.metadata[CONTINUED_KEY] == 1 and ctx.state.latest_weight_version == 4
    assert out.response == tokenizer.decode([72, 105, 33, 44, 258], skip_special_tokens=True)


def test_every_update_continues_again_until_the_budget_is_spent(tokenizer):
    engine = UpdatedEngine([(*FIRST, "abort", "3", SGLANG_ABORT, None),
                            ([44], [-2.0], "abort", "4", WEIGHT_UPDATE_ABORT, None),
                            ([50] * 6, [-0.5] * 6, "length", "5", None, None)])
    out = asyncio.run(generate(context(tokenizer, engine, partial_rollout=True), Sample(prompt="x")))
    assert [r["params"]["max_new_tokens"] for r in engine.requests] == [10, 7, 6]
    assert out.token_versions == [3, 3, 3, 4, 5, 5, 5, 5, 5, 5] and out.response_length == 10
    assert out.status is Status.TRUNCATED and out.metadata[CONTINUED_KEY] == 2


def test_without_the_switch_other_aborts_and_stopped_samples_end_aborted(tokenizer):
    off = UpdatedEngine([(*FIRST, "abort", "3", WEIGHT_UPDATE_ABORT, None)])
    out = asyncio.run(generate(context(tokenizer, off), Sample(prompt="x")))
    assert len(off.requests) == 1 and out.status is Status.ABORTED and out.token_versions is None  # one call, one version
    other = UpdatedEngine([(*FIRST, "abort", "3", "engine shutting down", None)])
    out = asyncio.run(generate(context(tokenizer, other, partial_rollout=True), Sample(prompt="x")))
    assert len(other.requests) == 1 and out.status is Status.ABORTED
    # the rollout step ended while the call ran: SGLang's abort by rid reads like an update's, and is not one
    stopped = UpdatedEngine([(*FIRST, "abort", "3", SGLANG_ABORT, None)])
    ctx = context(tokenizer, stopped, partial_rollout=True)
    stopped.during = lambda: ctx.state.stopped.add(9)
    out = asyncio.run(generate(ctx, Sample(prompt="x", index=9)))
    assert len(stopped.requests) == 1 and out.status is Status.ABORTED and CONTINUED_KEY not in out.metadata


def test_a_call_an_update_fell_inside_leaves_the_token_versions_unknown(tokenizer):
    # retract / in_place: the engine went on itself, and says only the oldest and newest version of the call
    engine = UpdatedEngine([(*FIRST, "stop", "4", None, "3")])
    out = asyncio.run(generate(context(tokenizer, engine, partial_rollout=True), Sample(prompt="x")))
    assert out.token_versions is None and out.weight_versions == ["3", "4"] and out.validate()


def test_one_request_for_the_group_and_an_interrupted_sample_goes_on_alone(tokenizer):
    engine = UpdatedEngine([(*FIRST, "abort", "3", WEIGHT_UPDATE_ABORT, None),  # sample 4: cut by the update
                            ([70, 258], [-0.5, -0.25], "stop", "3", None, None),  # sample 5: done before it
                            (*REST, "stop", "4", None, None)])  # sample 4 goes on with version 4
    ctx = context(tokenizer, engine, partial_rollout=True, request_per="group")
    group = [Sample(prompt="What is 2+3?", index=4, group_index=2), Sample(prompt="What is 2+3?", index=5, group_index=2)]
    cut, done = asyncio.run(generate_samples(ctx, group))
    prompt = encode_prompt(tokenizer, "What is 2+3?")
    first, second = engine.requests
    assert first["n"] == 2 and first["input_ids"] == prompt and first["params"]["sampling_seed"] == 104  # + i: 105
    assert "n" not in second and second["input_ids"] == prompt + [72, 105, 33]
    assert second["params"]["sampling_seed"] == 104 and second["params"]["max_new_tokens"] == 7  # sample 4's own
    assert cut.tokens == prompt + [72, 105, 33, 44, 258] and cut.token_versions == [3, 3, 3, 4, 4]
    assert cut.metadata[CONTINUED_KEY] == 1 and cut.status is Status.COMPLETED
    assert done.tokens == prompt + [70, 258] and done.token_versions == [3, 3] and CONTINUED_KEY not in done.metadata
    assert ctx.state.in_flight == {}
