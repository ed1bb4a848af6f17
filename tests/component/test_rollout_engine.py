"""The default generate fn and rollout fn against a real embedded engine (in this process, on loopback) on
the tiny model: token-in-token-out, logprobs, weight versions, truncation, and a rollout step with
over-sampling, the zero-variance filter, leftovers aborted by rid and their prompts returned."""

import asyncio
import dataclasses
import statistics

import pytest
import torch

from verst.config import RewardConfig, RolloutConfig, SamplingConfig
from verst.data import PromptSource
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer
from verst.inference_client.client import EngineClient
from verst.models.loader import load_model_and_tokenizer
from verst.models.prompts import encode_prompt
from verst.rollout.generate import CACHED_TOKENS_KEY, ENGINE_PROMPT_TOKENS_KEY, generate
from verst.rollout.plugins import RolloutContext
from verst.rollout.rollout_fn import run_rollout
from verst.types import Sample, Status

torch.set_num_threads(1)
HERE = __name__
N = 4
SLOW_TOKENS = 900  # far more than the step needs: these groups can only end by being aborted


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    with BackgroundServer(EngineCore(model, tokenizer, EngineConfig(max_running_requests=32))) as server:
        yield server, tokenizer


class RecordingClient(EngineClient):
    """The real client, keeping every reply so tests compare the sample with what the engine sent."""

    def __init__(self, url):
        super().__init__(url)
        self.replies = []

    async def generate(self, input_ids=None, sampling_params=None, **kw):
        result = await super().generate(input_ids, sampling_params, **kw)
        self.replies.append((list(input_ids), dict(sampling_params), result))
        return result


def with_client(served, body):
    server, tokenizer = served

    async def main():
        async with RecordingClient(server.url) as client:
            return await body(client, tokenizer)

    return asyncio.run(main())


def make_ctx(client, tokenizer, sampling_params=None, **rollout_kw):
    sampling = rollout_kw.pop("sampling", SamplingConfig(seed=11))
    ctx = RolloutContext(engine=client, tokenizer=tokenizer, rollout=RolloutConfig(sampling=sampling, **rollout_kw))
    if sampling_params:
        ctx.sampling_params = {**ctx.sampling_params, **sampling_params}
    return ctx


def test_tokens_are_the_prompt_ids_plus_the_engine_output_ids(served):
    async def body(client, tokenizer):
        version = await client.get_weight_version()
        ctx = make_ctx(client, tokenizer, max_response_tokens=8)
        sample = await generate(ctx, Sample(prompt="What is 12+34?", index=3))
        (sent_ids, params, result), = client.replies
        prompt_ids = encode_prompt(tokenizer, "What is 12+34?")
        assert sent_ids == prompt_ids and params["sampling_seed"] == 14 and params["max_new_tokens"] == 8
        assert sample.tokens == prompt_ids + result.output_ids and sample.prompt_tokens == prompt_ids
        assert sample.response_length == len(result.output_ids) == len(sample.rollout_logprobs) > 0
        assert sample.rollout_logprobs == result.logprobs and all(lp <= 0 for lp in sample.rollout_logprobs)
        assert sample.loss_mask == [1] * sample.response_length
        assert sample.weight_versions == [version] and ctx.state.latest_weight_version == int(version)
        assert sample.response == tokenizer.decode(result.output_ids, skip_special_tokens=True)
        assert sample.metadata[ENGINE_PROMPT_TOKENS_KEY] == len(prompt_ids)
        # the per-request seed makes the sample reproducible straight from the engine
        again = await client.generate(prompt_ids, {"max_new_tokens": 8, "sampling_seed": 14})
        assert again.output_ids == result.output_ids

    with_client(served, body)


def test_statuses_from_the_length_limit_the_context_cap_and_a_stop_token(served):
    async def body(client, tokenizer):
        prompt_ids = encode_prompt(tokenizer, "hello")
        ctx = make_ctx(client, tokenizer, {"ignore_eos": True}, max_response_tokens=3)
        capped = make_ctx(client, tokenizer, {"ignore_eos": True}, max_response_tokens=8,
                          max_context_tokens=len(prompt_ids) + 2)
        truncated, at_context = await asyncio.gather(generate(ctx, Sample(prompt="hello")),
                                                     generate(capped, Sample(prompt="hello")))
        assert truncated.status is Status.TRUNCATED and truncated.response_length == 3
        assert at_context.status is Status.TRUNCATED and len(at_context.tokens) == len(prompt_ids) + 2
        greedy = (await client.generate(prompt_ids, {"max_new_tokens": 1, "temperature": 0})).output_ids[0]
        stop = make_ctx(client, tokenizer, sampling=SamplingConfig(temperature=0, stop_token_ids=[greedy]))
        completed = await generate(stop, Sample(prompt="hello"))
        assert completed.status is Status.COMPLETED and completed.response_tokens == [greedy]

    with_client(served, body)


def test_the_weight_version_of_each_engine_call_is_recorded(served):
    async def body(client, tokenizer):
        version = str(int(await client.get_weight_version()) + 5)
        await client.update_weight_version(version)
        ctx = make_ctx(client, tokenizer, max_response_tokens=2)
        samples = await asyncio.gather(*(generate(ctx, Sample(prompt="x", index=i)) for i in range(3)))
        assert [s.weight_versions for s in samples] == [[version]] * 3
        assert [r.weight_version for _, _, r in client.replies] == [version] * 3
        assert ctx.state.latest_weight_version == int(version)

    with_client(served, body)


def test_a_partial_rollout_goes_on_across_a_weight_update_from_its_last_token(served):
    """pause(abort) → new version → continue, as the syncer does, while a request decodes: the sample is the
    first call's output followed by the continuation's, each token with the version that sampled it."""
    async def body(client, tokenizer):
        old = int(await client.get_weight_version())
        ctx = make_ctx(client, tokenizer, {"ignore_eos": True}, max_response_tokens=SLOW_TOKENS, partial_rollout=True)
        task = asyncio.create_task(generate(ctx, Sample(prompt="hello", index=2)))
        while (await client.get_server_info())["internal_states"][0]["num_running_reqs"] == 0:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # some tokens decoded on the old weights
        await client.pause("abort")
        await client.update_weight_version(str(old + 1))
        await client.continue_generation()
        return old, await task, client.replies

    old, sample, replies = with_client(served, body)
    (first_ids, first_params, first), (second_ids, second_params, second) = replies
    n = len(first.output_ids)
    assert first.aborted_for_weight_update and 0 < n < SLOW_TOKENS and first.weight_version == str(old)
    assert second_ids == first_ids + first.output_ids and second_params["max_new_tokens"] == SLOW_TOKENS - n
    assert sample.tokens == first_ids + first.output_ids + second.output_ids
    assert sample.rollout_logprobs == first.logprobs + second.logprobs
    assert sample.token_versions == [old] * n + [old + 1] * (SLOW_TOKENS - n)
    assert sample.weight_versions == [str(old), str(old + 1)]
    assert sample.status is Status.TRUNCATED and sample.response_length == SLOW_TOKENS  # ignore_eos: the budget


# ---- a rollout step ---------------------------------------------------------------------------
RETURNED: list[Sample] = []


async def parity_reward(sample):
    """Odd groups score 0/1 by sample parity; even groups all 1.0 (zero variance: filtered)."""
    return float(sample.index % 2) if sample.group_index % 2 else 1.0


async def shaped_generate(ctx, sample):
    """The default generate fn with a per-group length: even groups end after 1 token, odd ones after
    12, every third group would run for SLOW_TOKENS (it is still generating when the batch fills)."""
    gi = sample.group_index
    tokens = SLOW_TOKENS if gi % 3 == 2 else 1 if gi % 2 == 0 else 12
    shaped = dataclasses.replace(ctx, rollout=ctx.rollout.model_copy(update={"max_response_tokens": tokens}),
                                 sampling_params={**ctx.sampling_params, "ignore_eos": True})
    result = await generate(shaped, sample)
    RETURNED.append(result)
    return result


def test_rollout_step_filters_over_samples_and_aborts_leftovers(served):
    RETURNED.clear()
    prompts = [Sample(prompt=f"{i}+{i}=", label=str(2 * i)) for i in range(12)]

    async def body(client, tokenizer):
        cfg = RolloutConfig(batch_size=1, n_samples_per_prompt=N, over_sampling_batch_size=3,
                            dynamic_filter="zero_std", return_partial_to_source=True, sampling=SamplingConfig(seed=0),
                            generate_fn=f"{HERE}:shaped_generate")
        source = PromptSource(prompts, shuffle=False)
        ctx = RolloutContext(engine=client, tokenizer=tokenizer, rollout=cfg, source=source,
                             reward=RewardConfig(type="custom", path=f"{HERE}:parity_reward"))
        batch = await run_rollout(ctx, 1)
        info = await client.get_server_info()
        return batch, source.state_dict()["returned"], info["internal_states"][0]["num_running_reqs"]

    batch, returned_rows, running = with_client(served, body)
    (group,) = batch.groups
    assert group[0].group_index == 1 and [s.reward for s in group] == [0.0, 1.0, 0.0, 1.0]
    m = batch.metrics
    assert m["rollout/launched_groups"] == 3 and m["rollout/kept_groups"] == 1
    # group 0 (1 token) is normally filtered before group 1 fills the batch; a slow scheduler may make it
    # a leftover instead. Group 2 is always a leftover, aborted by rid while generating.
    assert m["rollout/filtered_groups"] + m["rollout/aborted_groups"] == 2 and m["rollout/aborted_groups"] >= 1
    assert m["rollout/zero_std_groups_dropped"] == m["rollout/filtered_groups"]
    slow = [s for s in RETURNED if s.group_index == 2]
    assert len(slow) == N and all(s.status is Status.ABORTED and s.response_length < SLOW_TOKENS for s in slow)
    assert all("aborted by the engine" in s.metadata["generate_error"] for s in slow)
    assert running == 0  # nothing of the step is left on the engine
    assert m["rollout/returned_groups"] == m["rollout/aborted_groups"] == len(returned_rows) and 2 in returned_rows
    # metrics against the samples
    rewards = [s.reward for s in group]
    assert m["rollout/reward_mean"] == statistics.fmean(rewards) and m["rollout/reward_std"] == 0.5
    assert m["rollout/response_length_mean"] == 12 and m["rollout/truncated_ratio"] == 1.0
    assert m["rollout/weight_version_mean"] == statistics.fmean(int(s.weight_versions[0]) for s in group)
    cached = sum(s.metadata[CACHED_TOKENS_KEY] for s in RETURNED)
    prompt_tokens = sum(s.metadata[ENGINE_PROMPT_TOKENS_KEY] for s in RETURNED)
    assert m["rollout/prefix_cache_hit_rate"] == pytest.approx(cached / prompt_tokens)
