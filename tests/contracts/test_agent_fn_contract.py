"""Contract of the agent fn layer, as the agentic generate fn (verst.rollout.agentic) keeps it:

- named by import path in `rollout.agent_fn` (with `rollout.generate_fn = "verst.rollout.agentic:generate"`);
- called as `run(base_url, prompt, request_kwargs, metadata)`: `base_url` is the session's OpenAI base URL
  `{server}/sessions/{id}/v1`, `prompt` the data prompt, `request_kwargs` keyword arguments that the official
  client's `chat.completions.create` accepts, `metadata` a copy of the sample's metadata;
- returns a dict (merged into the sample's metadata) or None; anything else is a broken agent and raises;
- an exception it raises is the episode's outcome: the sample comes back ABORTED with the reason;
- the session is deleted whatever happens, and the sample's tokens are the session's trajectory.

The engine is a scripted stand-in at its HTTP edge, so the agent sees deterministic tool calls.
"""

import asyncio
import json

import openai
import pytest

from verst.config import RolloutConfig, SamplingConfig
from verst.inference_client.client import EngineClient
from verst.rollout.agentic import SERVER_KEY
from verst.rollout.plugins import RolloutContext
from verst.rollout.worker import GENERATE_ERROR_KEY
from verst.session.scripted import ScriptedEngine
from verst.types import Sample, Status

HERE = __name__
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
SEEN: list[tuple] = []


# ---- agents ---------------------------------------------------------------------------------------
async def calculator_agent(base_url, prompt, request_kwargs, metadata):
    """A reference agent: runs tool calls until the model answers; reports its turns."""
    SEEN.append((base_url, prompt, dict(request_kwargs), dict(metadata)))
    metadata["scratch"] = "agents may scribble on their copy"
    messages, turns = [{"role": "user", "content": prompt}], 0
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        while True:
            reply = await client.chat.completions.create(model="policy", messages=messages, tools=metadata["tools"],
                                                         **request_kwargs)
            turns += 1
            message = reply.choices[0].message
            messages.append(message)
            if not message.tool_calls:
                return {"agent_turns": turns, "answer": message.content}
            for call in message.tool_calls:
                args = json.loads(call.function.arguments)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(args["a"] + args["b"])})


async def silent_agent(base_url, prompt, request_kwargs, metadata):
    return None


async def crashing_agent(base_url, prompt, request_kwargs, metadata):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
    raise ConnectionError("sandbox unreachable")


async def sloppy_agent(base_url, prompt, request_kwargs, metadata):
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": prompt}])
    return "done"


# ---- harness --------------------------------------------------------------------------------------
def run_episode(tok, agent_path, sample, **rollout_kw):
    """The agentic generate fn and agent fn resolved from the config tree, one sample generated."""
    engine = ScriptedEngine(tok, [CALL, "The sum is 3."])
    rollout = RolloutConfig(generate_fn="verst.rollout.agentic:generate", agent_fn=agent_path,
                            max_response_tokens=96, max_prompt_tokens=1024, **rollout_kw)

    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client:
            ctx = RolloutContext(engine=client, tokenizer=tok, rollout=rollout)
            try:
                result = await ctx.generate_fn(ctx, sample)
                return result, len(ctx.resources[SERVER_KEY].manager), dict(ctx.state.in_flight)
            finally:
                await ctx.aclose()

    result, open_sessions, in_flight = asyncio.run(main())
    assert open_sessions == 0 and in_flight == {}  # the session is deleted and no request stays registered
    return result, engine


def make_sample(**meta):
    return Sample(prompt="What is 1+2?", index=3, group_index=1, metadata={"tools": [ADD], **meta})


def test_the_agent_is_called_with_the_session_url_prompt_openai_kwargs_and_a_metadata_copy(tok):
    SEEN.clear()
    sample = make_sample(row=7)
    result, engine = run_episode(tok, f"{HERE}:calculator_agent", sample, sampling=SamplingConfig(seed=100, stop=["!"]))
    (base_url, prompt, kwargs, metadata), = SEEN
    session_id = engine.calls[0].routing_key
    assert base_url.endswith(f"/sessions/{session_id}/v1") and base_url.startswith("http://127.0.0.1:")
    assert prompt == "What is 1+2?" and metadata == {"tools": [ADD], "row": 7}
    # keyword arguments of chat.completions.create (the agent passed them through unchanged)
    assert kwargs == {"temperature": 1.0, "top_p": 1.0, "max_tokens": 96, "seed": 103, "stop": ["!"]}
    assert engine.calls[0].sampling_params["sampling_seed"] == 103
    assert result is sample and "scratch" not in result.metadata  # the agent's copy, not the sample's
    assert result.metadata["agent_turns"] == 2 and result.metadata["answer"] == "The sum is 3."


def test_the_sample_is_the_sessions_trajectory(tok):
    result, engine = run_episode(tok, f"{HERE}:calculator_agent", make_sample())
    c0, c1 = engine.calls
    assert result.tokens == c1.input_ids + c1.output_ids and result.prompt_tokens == c0.input_ids
    n_tool = len(c1.input_ids) - len(c0.input_ids) - len(c0.output_ids)
    assert result.loss_mask == [1] * len(c0.output_ids) + [0] * n_tool + [1] * len(c1.output_ids)
    assert result.rollout_logprobs == c0.logprobs + [0.0] * n_tool + c1.logprobs
    assert result.status is Status.COMPLETED and result.weight_versions == ["0", "0"]
    assert result.response == "The sum is 3." and (result.index, result.group_index) == (3, 1)


def test_an_agent_returning_none_keeps_the_metadata_and_one_that_never_asks_is_aborted(tok):
    result, _ = run_episode(tok, f"{HERE}:silent_agent", make_sample(row=1))
    assert result.status is Status.ABORTED and "never asked for a completion" in result.metadata[GENERATE_ERROR_KEY]
    assert result.metadata["row"] == 1 and result.tokens == []


def test_an_agent_exception_is_an_aborted_sample_with_the_reason(tok):
    result, engine = run_episode(tok, f"{HERE}:crashing_agent", make_sample())
    assert result.status is Status.ABORTED and len(engine.calls) == 1
    assert "ConnectionError('sandbox unreachable')" in result.metadata[GENERATE_ERROR_KEY]


def test_a_non_dict_return_is_a_broken_agent(tok):
    with pytest.raises(TypeError, match="sloppy_agent.*returned str; expected dict or None"):
        run_episode(tok, f"{HERE}:sloppy_agent", make_sample())


def test_the_agentic_generate_fn_needs_an_agent_fn(tok):
    with pytest.raises(ValueError, match="rollout.agent_fn is not set"):
        run_episode(tok, None, make_sample())
