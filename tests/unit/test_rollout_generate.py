"""The default single-turn generate fn against a scripted engine client (the HTTP edge): request shape,
token budget, seeds, rejection of long prompts, statuses and the recorded tokens. The real engine is
exercised in tests/component/test_rollout_engine.py."""

import asyncio

import pytest

from verst.config import DataConfig, RolloutConfig, SamplingConfig
from verst.inference_client.client import GenerateResult
from verst.models.chat_template import TINY_CHAT_TEMPLATE
from verst.models.loader import load_tokenizer
from verst.models.prompts import encode_prompt
from verst.models.tokenizer import save_tokenizer
from verst.rollout.generate import (
    CACHED_TOKENS_KEY,
    ENGINE_PROMPT_TOKENS_KEY,
    PROMPT_TOO_LONG_KEY,
    finish_status,
    generate,
    generate_samples,
)
from verst.rollout.plugins import RolloutContext
from verst.rollout.worker import GENERATE_ERROR_KEY
from verst.types import Sample, Status


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return load_tokenizer(save_tokenizer(tmp_path_factory.mktemp("tok"), TINY_CHAT_TEMPLATE))


class ScriptedEngine:
    """Replies with `output` (ids) and `finish`; records every request and what was in flight meanwhile."""

    def __init__(self, output=(72, 105, 258), finish="stop", version="3", logprobs=None, cached=2, oldest=None):
        self.output, self.finish, self.version, self.cached = list(output), finish, version, cached
        self.oldest = oldest  # the reply's oldest_weight_version (a sync inside the call), else `version`
        self.logprobs = logprobs
        self.requests, self.in_flight_seen = [], []
        self.ctx = None

    async def generate(self, input_ids, sampling_params, *, rid=None, return_logprob=True):
        self.requests.append({"input_ids": list(input_ids), "params": dict(sampling_params), "rid": rid,
                              "return_logprob": return_logprob})
        if self.ctx is not None:
            self.in_flight_seen.append(dict(self.ctx.state.in_flight))
        await asyncio.sleep(0)
        n = len(self.output)
        logprobs = self.logprobs if self.logprobs is not None else [-0.25 * (i + 1) for i in range(n)]
        finish = {"type": self.finish} | ({"message": "paused for a weight update"} if self.finish == "abort" else {})
        meta = {"id": rid, "finish_reason": finish, "prompt_tokens": len(input_ids), "completion_tokens": n,
                "cached_tokens": self.cached, "weight_version": self.version,
                **({"oldest_weight_version": self.oldest} if self.oldest is not None else {}),
                "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, self.output)]}
        return GenerateResult.from_reply({"text": "", "output_ids": list(self.output), "meta_info": meta})

    async def abort(self, rid):
        pass


def context(tokenizer, engine, **rollout):
    sampling = rollout.pop("sampling", SamplingConfig(temperature=0.7, top_p=0.9, top_k=20, stop_token_ids=[258]))
    data = rollout.pop("data", DataConfig())
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, rollout=RolloutConfig(sampling=sampling, **rollout),
                         data=data)
    engine.ctx = ctx
    return ctx


def run(coro):
    return asyncio.run(coro)


def test_a_sync_inside_the_call_records_both_versions(tokenizer):
    # Tokens from versions 2 and 3: staleness counts from 2, and the sample counts as mixed.
    ctx = context(tokenizer, ScriptedEngine(version="3", oldest="2"), max_response_tokens=12)
    out = run(generate(ctx, Sample(prompt="What is 2+3?", label="5")))
    assert out.weight_versions == ["2", "3"] and out.oldest_weight_version() == 2
    assert ctx.state.latest_weight_version == 3


def test_records_engine_ids_and_logprobs_token_in_token_out(tokenizer):
    engine = ScriptedEngine()
    ctx = context(tokenizer, engine, max_response_tokens=12)
    sample = Sample(prompt="What is 2+3?", label="5", index=5, group_index=1)
    out = run(generate(ctx, sample))
    prompt_ids = encode_prompt(tokenizer, "What is 2+3?")
    sent = engine.requests[0]
    assert sent["input_ids"] == prompt_ids and sent["return_logprob"] is True
    assert sent["params"] == {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "stop_token_ids": [258],
                              "max_new_tokens": 12}
    assert out is sample and out.tokens == prompt_ids + [72, 105, 258]
    assert out.response_length == 3 and out.loss_mask == [1, 1, 1]
    assert out.rollout_logprobs == [-0.25, -0.5, -0.75]
    assert out.weight_versions == ["3"] and ctx.state.latest_weight_version == 3
    assert out.status is Status.COMPLETED and out.response == "Hi"  # eos is special: dropped from the text
    assert out.metadata[CACHED_TOKENS_KEY] == 2 and out.metadata[ENGINE_PROMPT_TOKENS_KEY] == len(prompt_ids)
    assert ctx.state.in_flight == {} and engine.in_flight_seen == [{sent["rid"]: 5}]


def test_chat_template_options_and_pretokenized_prompts(tokenizer):
    engine = ScriptedEngine()
    tools = [{"type": "function", "function": {"name": "add", "parameters": {}}}]
    ctx = context(tokenizer, engine, data=DataConfig(system_prompt="Be brief."), max_prompt_tokens=1000)
    out = run(generate(ctx, Sample(prompt="hi", metadata={"tools": tools})))
    assert out.status is Status.COMPLETED, out.metadata
    expected = encode_prompt(tokenizer, "hi", system_prompt="Be brief.", tools=tools)
    assert engine.requests[0]["input_ids"] == expected
    ctx = context(tokenizer, engine, data=DataConfig(apply_chat_template=False))
    run(generate(ctx, Sample(prompt="1+1=")))
    assert engine.requests[1]["input_ids"] == tokenizer.encode("1+1=", add_special_tokens=False)
    run(generate(ctx, Sample(tokens=[5, 6, 7], prompt="ignored")))
    assert engine.requests[2]["input_ids"] == [5, 6, 7]


def test_seed_is_base_plus_sample_index_and_rids_are_unique(tokenizer):
    engine = ScriptedEngine()
    ctx = context(tokenizer, engine, sampling=SamplingConfig(seed=100))

    async def three():
        return await asyncio.gather(*(generate(ctx, Sample(prompt="x", index=i)) for i in (0, 3, 3)))

    run(three())
    assert [r["params"]["sampling_seed"] for r in engine.requests] == [100, 103, 103]
    assert len({r["rid"] for r in engine.requests}) == 3
    ctx = context(tokenizer, engine, sampling=SamplingConfig())
    run(generate(ctx, Sample(prompt="x", index=4)))
    assert "sampling_seed" not in engine.requests[-1]["params"]


def test_response_budget_capped_by_the_context(tokenizer):
    engine = ScriptedEngine(output=[1, 2], finish="length")
    n_prompt = len(encode_prompt(tokenizer, "abc"))
    ctx = context(tokenizer, engine, max_response_tokens=16, max_context_tokens=n_prompt + 2)
    out = run(generate(ctx, Sample(prompt="abc")))
    assert engine.requests[0]["params"]["max_new_tokens"] == 2
    assert out.status is Status.TRUNCATED and len(out.tokens) == n_prompt + 2


@pytest.mark.parametrize("limit", ["max_prompt_tokens", "max_context_tokens"])
def test_too_long_prompt_is_not_sent_and_comes_back_aborted_with_the_reason(tokenizer, limit):
    engine = ScriptedEngine()
    n_prompt = len(encode_prompt(tokenizer, "a long prompt"))
    kwargs = {"max_prompt_tokens": n_prompt - 1} if limit == "max_prompt_tokens" else {
        "max_context_tokens": n_prompt, "max_response_tokens": 4}
    ctx = context(tokenizer, engine, **kwargs)
    out = run(generate(ctx, Sample(prompt="a long prompt", index=9)))
    assert engine.requests == []
    assert out.status is Status.ABORTED and out.response_length == 0 and out.tokens
    assert out.metadata[PROMPT_TOO_LONG_KEY] == n_prompt
    assert f"prompt has {n_prompt} tokens" in out.metadata[GENERATE_ERROR_KEY]
    assert f"rollout.{limit}" in out.metadata[GENERATE_ERROR_KEY]


def test_engine_abort_gives_an_aborted_sample_with_its_partial_tokens(tokenizer):
    engine = ScriptedEngine(output=[65, 66], finish="abort")
    ctx = context(tokenizer, engine)
    out = run(generate(ctx, Sample(prompt="x")))
    assert out.status is Status.ABORTED and out.response_length == 2 and out.weight_versions == ["3"]
    assert "paused for a weight update" in out.metadata[GENERATE_ERROR_KEY]


def test_a_stopped_sample_is_not_sent(tokenizer):
    engine = ScriptedEngine()
    ctx = context(tokenizer, engine)
    ctx.state.stopped.add(7)
    out = run(generate(ctx, Sample(prompt="x", index=7)))
    assert engine.requests == [] and out.status is Status.ABORTED


def test_bad_engine_replies_and_resumed_samples_fail_loudly(tokenizer):
    ctx = context(tokenizer, ScriptedEngine(logprobs=[-1.0]))
    with pytest.raises(ValueError, match="1 output logprobs for 3 output ids"):
        run(generate(ctx, Sample(prompt="x")))
    with pytest.raises(ValueError, match="already has response_length = 2"):
        run(generate(ctx, Sample(tokens=[1, 2, 3], response_length=2, loss_mask=[1, 1], rollout_logprobs=[0, 0])))
    with pytest.raises(ValueError, match="finish_reason 'eos'"):
        finish_status("eos")
    assert [finish_status(r) for r in ("stop", "length", "abort")] == [Status.COMPLETED, Status.TRUNCATED,
                                                                         Status.ABORTED]


def test_a_group_in_one_request_is_refused_before_sending_what_one_sample_would_be(tokenizer):
    engine = ScriptedEngine()  # no generate_samples: nothing below may reach it
    n_prompt = len(encode_prompt(tokenizer, "a long prompt"))
    ctx = context(tokenizer, engine, max_prompt_tokens=n_prompt - 1, request_per="group")
    group = [Sample(prompt="a long prompt", index=i, group_index=1) for i in (4, 5)]
    out = run(generate_samples(ctx, group))
    assert all(s.status is Status.ABORTED and s.metadata[PROMPT_TOO_LONG_KEY] == n_prompt for s in out)
    ctx = context(tokenizer, engine, request_per="group")
    ctx.state.stopped.add(4)
    assert all(s.status is Status.ABORTED for s in run(generate_samples(ctx, [Sample(prompt="x", index=4)])))
    ctx = context(tokenizer, engine, request_per="group", sampling=SamplingConfig(seed=1))
    with pytest.raises(ValueError, match=r"sample indices \[4, 6\] are not consecutive"):
        run(generate_samples(ctx, [Sample(prompt="x", index=4), Sample(prompt="x", index=6)]))
    assert engine.requests == []
