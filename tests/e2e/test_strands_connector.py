"""The Strands connector end to end: the Strands agent of examples/strands_calculator (strands' own API, a
`@tool` calculator) is the agent fn under the agentic generate fn; its OpenAI model provider talks to session-server sessions, and the
batch verst trains on holds exactly the engine's ids, with the loss mask on the model's turns only.

On the tiny model (untrained, so no success is checked) through the default rollout fn; and on a scripted
stand-in engine whose replies call the tool, so the tool's result is in the trajectory and masked."""

from __future__ import annotations

import asyncio

import pytest
import torch

pytest.importorskip("strands", reason="the strands extra: pip install 'verst[strands]'")

from examples.strands_calculator.agent import calculator  # noqa: E402
from tests.agent_accounting import check_trained_tokens_are_the_engines, model_runs, run_recorded_rollout  # noqa: E402
from verst.config import RewardConfig, RolloutConfig, SamplingConfig  # noqa: E402
from verst.connectors.strands import ANSWER_KEY, STOP_KEY, TOOL_CALLS_KEY, TURNS_KEY, StrandsAgent  # noqa: E402
from verst.data import PromptSource, make_splits  # noqa: E402
from verst.inference_client.client import EngineClient  # noqa: E402
from verst.models.loader import load_tokenizer  # noqa: E402
from verst.rollout.plugins import RolloutContext  # noqa: E402
from verst.session.scripted import ScriptedEngine  # noqa: E402
from verst.types import Sample, Status  # noqa: E402

torch.set_num_threads(1)
AGENT = dict(generate_fn="verst.rollout.agentic:generate", agent_fn="examples.strands_calculator.agent:run")
REWARD = RewardConfig(type="custom", path="examples.calculator.reward:final_answer")


def calculator_prompts(n: int) -> PromptSource:
    train, _ = make_splits("calculator", n_train=n, n_test=5, seed=0)
    rows = [p.to_row() for p in train]
    return PromptSource([Sample(prompt=r["prompt"], label=r["label"], metadata=r["metadata"]) for r in rows], seed=0)


def test_strands_episodes_train_on_the_engines_tokens(tiny_model_dir):
    rollout_cfg = RolloutConfig(**AGENT, n_samples_per_prompt=2, max_response_tokens=8,
                                max_prompt_tokens=1024, sampling=SamplingConfig(temperature=1.0, seed=0))
    batch, calls = run_recorded_rollout(tiny_model_dir, rollout_cfg, 2, reward=REWARD, source=calculator_prompts(20))

    samples = batch.samples
    assert [len(g) for g in batch.groups] == [2, 2]
    assert check_trained_tokens_are_the_engines(samples, calls) >= len(samples)
    for s in samples:
        assert s.metadata[TURNS_KEY] >= 1 and s.metadata[STOP_KEY] in ("end_turn", "max_tokens", "limit_turns")
        assert s.reward in (0.0, 1.0)
        if s.metadata[STOP_KEY] == "max_tokens":  # the model call hit max_response_tokens: truncated, no answer
            assert s.status is Status.TRUNCATED and s.metadata[ANSWER_KEY] is None


def test_a_strands_tool_call_round_trip_masks_the_tool_result(tmp_path):
    """Scripted replies call the calculator, then answer: the tool's result and the template around it
    are environment tokens."""
    from verst.models.chat_template import TINY_CHAT_TEMPLATE
    from verst.models.tokenizer import save_tokenizer

    tokenizer = load_tokenizer(save_tokenizer(tmp_path / "tok", TINY_CHAT_TEMPLATE))
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "9-9-6"}}\n</tool_call>'
    scripted = ScriptedEngine(tokenizer, [call, "The answer is -6."])
    sample = calculator_prompts(1).next_groups(1, 1)[0][0]
    rollout_cfg = RolloutConfig(**AGENT, max_response_tokens=96, max_prompt_tokens=1024)

    async def main():
        async with EngineClient("http://scripted-engine", transport=scripted) as client:
            ctx = RolloutContext(engine=client, tokenizer=tokenizer, rollout=rollout_cfg, reward=REWARD)
            try:
                return await ctx.generate_fn(ctx, sample)
            finally:
                await ctx.aclose()

    result = asyncio.run(main())
    assert check_trained_tokens_are_the_engines([result], scripted.calls) == 2
    (_, first_end), (second_start, _) = model_runs(result)
    between = tokenizer.decode(result.tokens[first_end:second_start])
    assert calculator("9-9-6") in between  # the tool ran; its result is masked
    assert result.metadata[ANSWER_KEY] == "The answer is -6." and result.metadata[STOP_KEY] == "end_turn"
    assert result.metadata[TURNS_KEY] == 2 and result.metadata[TOOL_CALLS_KEY] == 1
    assert result.status is Status.COMPLETED


def test_the_strands_agent_fn_refuses_a_factory_without_an_agent(tmp_path):
    from verst.models.chat_template import TINY_CHAT_TEMPLATE
    from verst.models.tokenizer import save_tokenizer
    from verst.rollout.worker import GENERATE_ERROR_KEY

    with pytest.raises(TypeError, match="make_agent must be callable"):
        StrandsAgent("not a factory")
    with pytest.raises(ValueError, match="max_turns = 0"):
        StrandsAgent(lambda model, metadata: None, max_turns=0)
    tokenizer = load_tokenizer(save_tokenizer(tmp_path / "tok", TINY_CHAT_TEMPLATE))

    async def main():
        async with EngineClient("http://scripted-engine", transport=ScriptedEngine(tokenizer, ["3"])) as client:
            ctx = RolloutContext(engine=client, tokenizer=tokenizer, agent_fn=StrandsAgent(lambda model, m: "agent"),
                                 rollout=RolloutConfig(generate_fn="verst.rollout.agentic:generate"))
            try:
                return await ctx.generate_fn(ctx, Sample(prompt="1+2=", index=0))
            finally:
                await ctx.aclose()

    aborted = asyncio.run(main())
    assert aborted.status is Status.ABORTED and "expected a strands Agent" in aborted.metadata[GENERATE_ERROR_KEY]
