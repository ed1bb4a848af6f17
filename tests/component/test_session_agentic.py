"""The agentic generate fn (agent fn -> session server -> engine) and the direct multi-turn generate fn
against a real embedded engine (tiny model, in this process): a rollout step end to end, an agent that
fails, the two paths giving the same trajectory, and the context closing its session server."""

import asyncio
import dataclasses

import httpx
import openai
import pytest
import torch

from verst.config import RolloutConfig, SamplingConfig
from verst.data import PromptSource
from verst.engine.core import EngineConfig, EngineCore
from verst.engine.process import BackgroundServer
from verst.inference_client.client import EngineClient
from verst.models.loader import load_model_and_tokenizer
from verst.models.prompts import prompt_messages
from verst.models.tokenizer import VOCAB_SIZE
from verst.rollout.agentic import SERVER_KEY, session_metrics, tito_metrics
from verst.rollout.agentic import generate as agentic_generate
from verst.rollout.generate import CACHED_TOKENS_KEY, ENGINE_PROMPT_TOKENS_KEY
from verst.rollout.multiturn import MultiTurnGenerate
from verst.rollout.plugins import RolloutContext
from verst.rollout.rollout_fn import run_rollout
from verst.rollout.worker import GENERATE_ERROR_KEY
from verst.types import Sample, Status

torch.set_num_threads(1)
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
USER = {"role": "user", "content": "What is 1+2?"}


def asked(n_calls):
    """The model's earlier turn, calling `add` n times (ids call_0, ...): the episode's tool results answer
    these calls, since a random tiny model never writes one itself."""
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "add", "arguments": "{}"}}
             for i in range(n_calls)]
    return {"role": "assistant", "content": "Adding.", "tool_calls": calls}


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    model, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    with BackgroundServer(EngineCore(model, tokenizer, EngineConfig(max_running_requests=32))) as server:
        yield server, tokenizer


async def tool_agent(base_url, prompt, request_kwargs, metadata):
    """`metadata['n_turns']` turns; after each reply but the last, a tool result (the turn number)."""
    messages = prompt_messages(prompt)
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as oai:
        for turn in range(metadata["n_turns"]):
            reply = await oai.chat.completions.create(model="policy", messages=messages, tools=metadata["tools"],
                                                      **request_kwargs)
            messages.append(reply.choices[0].message)
            if turn < metadata["n_turns"] - 1:
                messages.append({"role": "tool", "tool_call_id": f"call_{turn}", "content": str(turn)})
            if metadata.get("fail_after") == turn:
                raise RuntimeError("the sandbox died")
    return {"agent_turns": metadata["n_turns"]}


async def tool_env(messages, metadata):
    """The same episode as `tool_agent`, as an environment step for the direct multi-turn generate fn."""
    turn = sum(m["role"] == "tool" for m in messages)  # the replies so far, less one
    if turn >= metadata["n_turns"] - 1:
        return None
    return [{"role": "tool", "tool_call_id": f"call_{turn}", "content": str(turn)}]


def make_ctx(client, tokenizer, **kw):
    sampling = kw.pop("sampling", SamplingConfig(seed=5))
    rollout = RolloutConfig(sampling=sampling, max_response_tokens=6, max_prompt_tokens=1024, **kw)
    return RolloutContext(engine=client, tokenizer=tokenizer, rollout=rollout, generate_fn=agentic_generate,
                          agent_fn=tool_agent, reward_fn=one_reward)


async def one_reward(sample):
    return 1.0


def prompt(n_turns=3, **meta):
    return Sample(prompt=[USER, asked(n_turns - 1)], metadata={"tools": [ADD], "n_turns": n_turns, **meta})


def test_a_rollout_step_of_agent_episodes(served):
    server, tok = served

    async def main():
        async with EngineClient(server.url) as client:
            ctx = make_ctx(client, tok, batch_size=2, n_samples_per_prompt=2)
            ctx.source = PromptSource([prompt(2), prompt(3)], shuffle=False)
            batch = await run_rollout(ctx, 2)
            srv = ctx.resources[SERVER_KEY]
            open_sessions, in_flight, metrics = len(srv.manager), dict(ctx.state.in_flight), session_metrics(ctx)
            await ctx.aclose()
            return batch, open_sessions, in_flight, metrics, srv, ctx

    batch, open_sessions, in_flight, metrics, srv, ctx = asyncio.run(main())
    samples = batch.samples
    assert [len(s.weight_versions) for s in samples] == [2, 2, 3, 3]  # one version per engine call
    for s in samples:
        assert s.status in (Status.COMPLETED, Status.TRUNCATED) and s.reward == 1.0
        assert s.metadata["agent_turns"] == s.metadata["n_turns"]  # the agent's dict merged into the metadata
        assert len(s.metadata["turns"]) == s.metadata["n_turns"] and s.metadata["tito_mismatch"] is not None
        # the tool turns are in the response with mask 0; the sampled ids with mask 1 and their logprobs
        assert 0 < sum(s.loss_mask) < s.response_length
        assert all(lp < 0.0 for m, lp in zip(s.loss_mask, s.rollout_logprobs) if m)
        assert s.metadata[ENGINE_PROMPT_TOKENS_KEY] > 0 and s.metadata[CACHED_TOKENS_KEY] > 0  # turns hit the cache
    assert open_sessions == 0 and in_flight == {}  # every session deleted, every request unregistered
    assert metrics["rollout/tito_checked_sessions"] == 4.0
    assert set(tito_metrics(samples)) >= {"rollout/tito_mismatch_rate/any", "rollout/tito_mismatch_rate/assistant_text"}
    assert ctx.resources == {} and srv.url is not None
    with pytest.raises(httpx.ConnectError):  # ctx.aclose() stopped the server
        httpx.get(srv.url + "/health", timeout=2)


def test_an_agent_that_raises_gives_an_aborted_sample_with_the_reason(served):
    server, tok = served

    async def main():
        async with EngineClient(server.url) as client:
            ctx = make_ctx(client, tok)
            try:
                sample = await agentic_generate(ctx, prompt(3, fail_after=1))
                return sample, len(ctx.resources[SERVER_KEY].manager), dict(ctx.state.in_flight)
            finally:
                await ctx.aclose()

    sample, open_sessions, in_flight = asyncio.run(main())
    assert sample.status is Status.ABORTED and "the sandbox died" in sample.metadata[GENERATE_ERROR_KEY]
    assert len(sample.weight_versions) == 2 and sample.response_length > 0  # what it did is kept for inspection
    assert open_sessions == 0 and in_flight == {}


def test_the_session_path_and_the_direct_path_record_the_same_trajectory(served):
    server, tok = served
    # every token id stops generation: each turn is one greedy token ending with finish_reason "stop",
    # so both paths run every turn and the greedy engine samples the same ids for the same prefix
    one_token = SamplingConfig(temperature=0.0, stop_token_ids=list(range(VOCAB_SIZE)))

    async def main():
        async with EngineClient(server.url) as client:
            ctx = make_ctx(client, tok, sampling=one_token)
            direct = dataclasses.replace(ctx, generate_fn=MultiTurnGenerate(tool_env))
            try:
                via_session = await agentic_generate(ctx, prompt(4, n=0))
                via_ids = await direct.generate_fn(direct, prompt(4, n=1))
                return via_session, via_ids
            finally:
                await ctx.aclose()

    via_session, via_ids = asyncio.run(main())
    assert len(via_session.weight_versions) == len(via_ids.weight_versions) == 4
    assert via_session.tokens == via_ids.tokens and via_session.loss_mask == via_ids.loss_mask
    assert sum(via_ids.loss_mask) == 4 and via_session.status == via_ids.status == Status.COMPLETED
    # the same ids; logprobs agree up to the prefix cache's numerics
    assert via_session.rollout_logprobs == pytest.approx(via_ids.rollout_logprobs, abs=1e-4)
    assert [m["role"] for m in via_ids.metadata["messages"]] == ["user", "assistant"] + ["assistant", "tool"] * 3 + [
        "assistant"]
