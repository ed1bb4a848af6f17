"""The direct multi-turn generate fn (verst.rollout.multiturn, no session server) against a scripted engine:
the environment step named by import path, exact ids across turns, where an episode ends, bad steps."""

import asyncio
import json

import pytest

from verst.config import ImportPathError, RolloutConfig
from verst.inference_client.client import EngineClient
from verst.inference_client.protocol import WEIGHT_UPDATE_ABORT
from verst.models.loader import chat_prompt_ids
from verst.rollout.multiturn import MultiTurnGenerate
from verst.rollout.plugins import RolloutContext
from verst.session.scripted import Reply, ScriptedEngine
from verst.types import Sample, Status

HERE = __name__
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


async def calculator(messages, metadata):
    """Runs the last reply's tool calls; ends the episode when the reply calls none."""
    calls = messages[-1].get("tool_calls")
    if not calls:
        return None
    results = []
    for call in calls:
        args = json.loads(call["function"]["arguments"])
        results.append({"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] + args["b"])})
    return results


async def chatty(messages, metadata):
    return [{"role": "user", "content": "go on"}]


async def impostor(messages, metadata):
    return [{"role": "assistant", "content": "I am the model"}]


def run(tok, script, sample, generate_fn="verst.rollout.multiturn:generate", **rollout_kw):
    engine = ScriptedEngine(tok, script)
    rollout = RolloutConfig(generate_fn=generate_fn, max_prompt_tokens=1024, max_response_tokens=96, **rollout_kw)

    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client:
            ctx = RolloutContext(engine=client, tokenizer=tok, rollout=rollout)
            result = await ctx.generate_fn(ctx, sample)
            assert ctx.state.in_flight == {}
            return result

    return asyncio.run(main()), engine.calls


def test_tool_turns_append_the_engines_ids_and_the_tool_ids(tok):
    sample = Sample(prompt="What is 1+2?", metadata={"tools": [ADD], "env_step": f"{HERE}:calculator"})
    result, (c0, c1) = run(tok, [CALL, "The sum is 3."], sample)
    tool_ids = tok.encode("\n<|im_start|>user\n<tool_response>\n3\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
                          add_special_tokens=False)
    assert c0.input_ids == chat_prompt_ids(tok, [{"role": "user", "content": "What is 1+2?"}], tools=[ADD])
    assert c1.input_ids == c0.input_ids + c0.output_ids + tool_ids
    assert result.tokens == c1.input_ids + c1.output_ids
    assert result.loss_mask == [1] * len(c0.output_ids) + [0] * len(tool_ids) + [1] * len(c1.output_ids)
    assert result.rollout_logprobs == c0.logprobs + [0.0] * len(tool_ids) + c1.logprobs
    assert result.status is Status.COMPLETED and result.response == "The sum is 3."
    assert c0.routing_key == c1.routing_key and c0.routing_key.startswith("multiturn-")  # one engine per episode
    assert result.metadata["tito_mismatch"] == [] and len(result.metadata["messages"]) == 4


def test_an_episode_ends_at_max_turns_or_a_reply_cut_by_the_length_limit(tok):
    capped, calls = run(tok, ["a", "b", "c", "d"], Sample(prompt="hi", metadata={"max_turns": 3}),
                        generate_fn=f"{HERE}:CHATTY")
    assert len(calls) == 3 and capped.status is Status.COMPLETED
    cut, calls = run(tok, [Reply("a long reply", finish="length"), "b"], Sample(prompt="hi"),
                     generate_fn=f"{HERE}:CHATTY")
    assert len(calls) == 1 and cut.status is Status.TRUNCATED


def test_the_context_limit_truncates_between_turns(tok):
    n_prompt = len(chat_prompt_ids(tok, [{"role": "user", "content": "hi"}]))
    result, calls = run(tok, ["ok"], Sample(prompt="hi"), generate_fn=f"{HERE}:CHATTY", max_context_tokens=n_prompt + 6)
    assert len(calls) == 1 and result.status is Status.TRUNCATED and len(result.tokens) == n_prompt + 3


def test_bad_environment_steps_fail_naming_the_problem(tok):
    with pytest.raises(ValueError, match="metadata\\['env_step'\\] = None"):
        run(tok, ["ok"], Sample(prompt="hi"))
    with pytest.raises(ImportPathError, match="no attribute .no_such_step."):
        run(tok, ["ok"], Sample(prompt="hi", metadata={"env_step": f"{HERE}:no_such_step"}))
    with pytest.raises(ValueError, match="env step messages\\[0\\] has role 'assistant'"):
        run(tok, ["ok"], Sample(prompt="hi", metadata={"env_step": f"{HERE}:impostor"}))


CHATTY = MultiTurnGenerate(chatty, max_turns=8)


def test_with_partial_rollouts_a_turn_a_weight_update_aborted_goes_on_with_the_new_weights(tok):
    sample = Sample(prompt="What is 1+2?", metadata={"tools": [ADD], "env_step": f"{HERE}:calculator"})
    script = [Reply(CALL, weight_version="2"),
              Reply("The sum", finish="abort", message=WEIGHT_UPDATE_ABORT, weight_version="3"),
              Reply(" is 3.", weight_version="4")]
    result, (c0, cut, rest) = run(tok, script, sample, partial_rollout=True)
    # token in, token out: the continuation is sent the turn's input and its output so far, with the rest
    assert rest.input_ids == cut.input_ids + cut.output_ids and rest.routing_key == cut.routing_key
    assert rest.sampling_params["max_new_tokens"] == cut.sampling_params["max_new_tokens"] - len(cut.output_ids)
    n_env = len(cut.input_ids) - len(c0.input_ids) - len(c0.output_ids)
    assert result.tokens == rest.input_ids + rest.output_ids
    assert result.loss_mask == [1] * len(c0.output_ids) + [0] * n_env + [1] * (len(cut.output_ids) + len(rest.output_ids))
    assert result.rollout_logprobs == c0.logprobs + [0.0] * n_env + cut.logprobs + rest.logprobs
    # each token's version: the tool call by 2, the tool result read by 3, the answer by 3 then by 4
    assert result.token_versions == ([2] * len(c0.output_ids) + [3] * n_env + [3] * len(cut.output_ids)
                                     + [4] * len(rest.output_ids))
    assert result.status is Status.COMPLETED and result.response == "The sum is 3."
    assert result.metadata["continued_after_weight_update"] == 1 and result.metadata["tito_mismatch"] == []
    # without partial rollouts the same abort ends the episode aborted
    ended, calls = run(tok, script, Sample(prompt="What is 1+2?", metadata=dict(sample.metadata)))
    assert len(calls) == 2 and ended.status is Status.ABORTED and ended.token_versions is None
