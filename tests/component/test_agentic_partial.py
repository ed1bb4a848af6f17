"""Partial rollouts through the agentic generate fn: an OpenAI agent against the session server it starts, in
front of the scripted engine. A turn a weight update aborted reaches the agent as one completion, streamed or
not, and the sample carries the turn's versions token by token and the continuation in its metadata."""

import asyncio

import openai
import pytest

from verst.config import RolloutConfig
from verst.inference_client.client import EngineClient
from verst.inference_client.protocol import WEIGHT_UPDATE_ABORT
from verst.rollout.agentic import generate
from verst.rollout.generate import CONTINUED_KEY
from verst.rollout.plugins import RolloutContext
from verst.session.scripted import Reply, ScriptedEngine
from verst.types import Sample, Status

SCRIPT = [Reply("The sum", finish="abort", message=WEIGHT_UPDATE_ABORT, weight_version="3"),
          Reply(" is 3.", weight_version="4")]


async def answer_agent(base_url, prompt, request_kwargs, metadata):
    """One completion, streamed when `metadata['stream']`; what the agent read comes back in the metadata."""
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as oai:
        messages = [{"role": "user", "content": prompt}]
        if not metadata.get("stream"):
            reply = await oai.chat.completions.create(model="policy", messages=messages, **request_kwargs)
            return {"read": reply.choices[0].message.content, "finish": reply.choices[0].finish_reason}
        chunks = await oai.chat.completions.create(model="policy", messages=messages, stream=True, **request_kwargs)
        text, finish = "", None
        async for chunk in chunks:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        return {"read": text, "finish": finish}


def episode(tok, stream, partial_rollout=True):
    engine = ScriptedEngine(tok, SCRIPT)

    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client:
            rollout = RolloutConfig(max_response_tokens=32, partial_rollout=partial_rollout)
            ctx = RolloutContext(engine=client, tokenizer=tok, rollout=rollout, generate_fn=generate,
                                 agent_fn=answer_agent)
            try:
                return await generate(ctx, Sample(prompt="What is 1+2?", metadata={"stream": stream}))
            finally:
                await ctx.aclose()

    return asyncio.run(main()), engine.calls


@pytest.mark.parametrize("stream", [False, True])
def test_the_agent_reads_one_completion_and_the_sample_each_tokens_version(tok, stream):
    sample, (cut, rest) = episode(tok, stream)
    assert rest.input_ids == cut.input_ids + cut.output_ids
    assert rest.sampling_params["max_new_tokens"] == 32 - len(cut.output_ids)
    assert sample.metadata["read"] == "The sum is 3." and sample.metadata["finish"] == "stop"
    assert sample.tokens == rest.input_ids + rest.output_ids and sample.status is Status.COMPLETED
    assert sample.rollout_logprobs == cut.logprobs + rest.logprobs
    assert sample.token_versions == [3] * len(cut.output_ids) + [4] * len(rest.output_ids)
    assert sample.weight_versions == ["3", "4"] and sample.metadata[CONTINUED_KEY] == 1


def test_without_partial_rollouts_the_episode_ends_aborted(tok):
    sample, calls = episode(tok, stream=False, partial_rollout=False)
    assert len(calls) == 1 and sample.metadata["finish"] == "abort" and sample.status is Status.ABORTED
    assert sample.token_versions is None and CONTINUED_KEY not in sample.metadata
