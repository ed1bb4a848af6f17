"""The calculator agent (official openai client) through the real session server, over a scripted engine
that replies with the gold turns: the trajectory equals the SFT encoding of the gold conversation, the
reward reads the agent's final answer, and the agentic evaluation counts every episode (also over an
in-process engine serving a real model, as the SFT loop evaluates)."""

import asyncio
import random

import pytest

from examples.calculator.agent import MAX_TURNS
from verst.config import VerstConfig
from verst.data.calculator import CONVERSATION_KEY, calculator_problem
from verst.eval import MixedVersionError
from verst.eval.agentic import evaluate_agentic, evaluate_agentic_local
from verst.inference_client.client import EngineClient
from verst.models.loader import load_model_and_tokenizer
from verst.models.prompts import encode_sft_conversation
from verst.rollout import RolloutContext, generate_and_reward
from verst.session.scripted import Reply, ScriptedEngine
from verst.types import Sample, Status

CFG = VerstConfig.model_validate({
    "rollout": {"generate_fn": "verst.rollout.agentic:generate", "agent_fn": "examples.calculator.agent:run",
                "max_response_tokens": 96, "max_context_tokens": 1024, "max_prompt_tokens": 1024},
    "reward": {"type": "custom", "path": "examples.calculator.reward:final_answer"},
})


def prompt_sample(seed, index=0):
    text, label, meta = calculator_problem(random.Random(seed))
    return Sample(prompt=[{"role": "user", "content": text}], label=label, metadata=meta, index=index,
                  group_index=index)


def gold_script(tok, sample):
    """What a model that learned the gold conversation samples: each loss-carrying run of the SFT
    encoding, without its end-of-turn token (the scripted engine appends it)."""
    ids, mask = encode_sft_conversation(tok, sample.prompt, sample.metadata[CONVERSATION_KEY],
                                        tools=sample.metadata["tools"])
    response, runs = ids[len(ids) - len(mask):], []
    for token, flag in zip(response, mask):
        if flag and (not runs or runs[-1][1] is False):
            runs.append(([], True))
        elif not flag and (not runs or runs[-1][1] is True):
            runs.append(([], False))
        runs[-1][0].append(token)
    texts = [tok.decode(t[:-1], skip_special_tokens=False) for t, flag in runs if flag]
    return texts, ids, mask


def run_episode(tok, script, sample, version="0"):
    engine = ScriptedEngine(tok, script, weight_version=version)

    async def main():
        async with EngineClient("http://scripted-engine", transport=engine) as client:
            ctx = RolloutContext.from_config(CFG, client, tok, source=None)
            try:
                return await generate_and_reward(ctx, sample)
            finally:
                await ctx.aclose()

    return asyncio.run(main())


def test_gold_episode_trajectory_equals_the_sft_encoding(tok):
    sample = prompt_sample(0)
    script, ids, mask = gold_script(tok, sample)
    assert len(script) == 3
    done = run_episode(tok, script, sample)
    assert done.status is Status.COMPLETED and done.reward == 1.0
    assert done.tokens == ids and done.loss_mask == mask  # what SFT teaches is what RL trains on
    meta = done.metadata
    assert meta["final_answer"] == sample.label and meta["agent_end"] == "answer"
    assert (meta["agent_turns"], meta["tool_calls"], meta["tool_errors"]) == (3, 2, 0)
    assert len(meta["turns"]) == 3  # the session's own per-turn records are kept


def test_episode_without_an_answer_scores_zero(tok):
    sample = prompt_sample(1)
    script, _, _ = gold_script(tok, sample)
    done = run_episode(tok, script[:1], sample)  # the first call, repeated until the turn limit
    assert done.reward == 0.0 and done.metadata["agent_end"] == "max_turns"
    assert done.metadata["agent_turns"] == MAX_TURNS == done.metadata["tool_calls"]
    cut = run_episode(tok, [script[0], Reply(script[1], finish="length")], prompt_sample(1))
    assert cut.reward == 0.0 and cut.metadata["agent_end"] == "length" and cut.metadata["final_answer"] is None
    assert cut.status is Status.TRUNCATED


def test_agentic_evaluation_counts_every_episode(tok):
    prompts = [prompt_sample(0, 0), prompt_sample(2, 1)]
    assert prompts[0].label != prompts[1].label
    script, _, _ = gold_script(tok, prompts[0])  # right for the first prompt only

    def evaluate(version, expect):
        engine = ScriptedEngine(tok, script, weight_version=version)

        async def main():
            async with EngineClient("http://scripted-engine", transport=engine) as client:
                return await evaluate_agentic(CFG, client, tok, prompts, expect_version=expect)

        return asyncio.run(main()), engine

    metrics, engine = evaluate("3", "3")
    assert metrics["eval/success"] == 0.5 and metrics["eval/n_prompts"] == 2
    assert metrics["eval/turns_mean"] == 3 and metrics["eval/tool_calls_mean"] == 2
    assert metrics["eval/aborted"] == 0 and metrics["eval/truncated_ratio"] == 0
    assert {c.sampling_params["temperature"] for c in engine.calls} == {0.0}  # greedy
    with pytest.raises(MixedVersionError, match=r"expected weight version '4'.*\['3'\]"):
        evaluate("3", "4")


def test_local_evaluation_runs_the_agent_on_an_in_process_engine(tiny_model_dir):
    """The SFT loop's evaluation: a real (untrained) model behind an embedded engine in this process."""
    model, tok = load_model_and_tokenizer(tiny_model_dir)
    cfg = CFG.model_copy(update={"eval": CFG.eval.model_copy(update={"max_response_tokens": 8})})
    metrics = evaluate_agentic_local(cfg, model, tok, [prompt_sample(s, s) for s in range(3)], max_running_requests=4)
    assert metrics["eval/n_prompts"] == 3 and metrics["eval/aborted"] == 0
    assert metrics["eval/success"] == 0.0  # random weights answer nothing right
    assert metrics["eval/response_length"] <= 8 * MAX_TURNS and metrics["eval/turns_mean"] >= 1
