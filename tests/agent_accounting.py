"""Token accounting of connector tests: an engine client that records what the engine was sent and sampled,
and the check that trajectories train on exactly those ids, with the loss mask on the engine's output only."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from verst.inference_client.client import EngineClient, GenerateResult
from verst.types import Sample


class Call(Protocol):
    """One engine generation: what it was sent, what it sampled (an `EngineCall`, or a `ScriptedEngine`'s)."""

    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


@dataclasses.dataclass
class EngineCall:
    input_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


class RecordingEngine:
    """An EngineClient that records every finished generation it serves, streamed or not."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.calls: list[EngineCall] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def generate(self, input_ids: list[int], *args: Any, **kwargs: Any) -> GenerateResult:
        result = await self.client.generate(input_ids, *args, **kwargs)
        self._record(input_ids, result)
        return result

    async def generate_stream(self, input_ids: list[int], *args: Any, **kwargs: Any) -> AsyncIterator[GenerateResult]:
        result = None
        async for result in self.client.generate_stream(input_ids, *args, **kwargs):
            yield result
        if result is not None:
            self._record(input_ids, result)

    def _record(self, input_ids: list[int], result: GenerateResult) -> None:
        self.calls.append(EngineCall(list(input_ids), list(result.output_ids), list(result.logprobs or [])))


def model_runs(sample: Sample) -> list[tuple[int, int]]:
    """(start, end) in `sample.tokens` of each run of loss-mask-1 tokens."""
    offset, runs, start = len(sample.tokens) - sample.response_length, [], None
    for i, bit in enumerate([*sample.loss_mask, 0]):
        if bit and start is None:
            start = i
        elif not bit and start is not None:
            runs.append((offset + start, offset + i))
            start = None
    return runs


def assert_engine_tokens(sample: Sample, calls: Sequence[Call]) -> None:
    """`calls` (one episode's engine calls, in order) account for `sample` exactly: each call was sent the
    trajectory so far, its output ids follow in `sample.tokens` with loss mask 1 and the engine's logprobs,
    and every other token (prompt, environment, template) has loss mask 0 and no logprob."""
    assert calls, f"sample {sample.index}: the engine was never called"
    tokens, start = sample.tokens, len(sample.tokens) - sample.response_length
    expected_mask = [0] * len(tokens)
    for i, call in enumerate(calls):
        n_in, n_out = len(call.input_ids), len(call.output_ids)
        assert tokens[:n_in] == call.input_ids, f"engine call {i} was sent other ids than the trajectory's prefix"
        assert tokens[n_in:n_in + n_out] == call.output_ids, f"engine call {i}'s output ids are not the trained ids"
        assert sample.rollout_logprobs[n_in - start:n_in - start + n_out] == call.logprobs, f"call {i}: logprobs"
        expected_mask[n_in:n_in + n_out] = [1] * n_out
    assert expected_mask[:start] == [0] * start, "engine output inside the prompt"
    assert sample.loss_mask == expected_mask[start:], "the loss mask is not exactly the engine's output"
    assert len(calls[-1].input_ids) + len(calls[-1].output_ids) == len(tokens), "tokens after the last engine call"
    masked = [lp for lp, bit in zip(sample.rollout_logprobs, sample.loss_mask) if not bit]
    assert all(lp == 0.0 for lp in masked), f"sample {sample.index}: a non-model token has a logprob"


def check_trained_tokens_are_the_engines(samples: list[Sample], calls: Sequence[Call]) -> int:
    """A batch's engine calls (any order, episodes interleaved) account for its samples exactly: the trainer's
    items hold the samples' ids and masks; each sample's calls, those whose input and output ids are a run of
    its loss-mask-1 tokens and what precedes it, pass `assert_engine_tokens`; every call is some sample's.
    Returns the number of model turns."""
    from verst.trainer.items import make_items

    unmatched, turns = list(calls), 0  # a group's samples send the same first prompt: each call is used once
    for sample, item in zip(samples, make_items(samples), strict=True):
        assert item.tokens.tolist() == sample.tokens
        assert item.loss_mask.tolist() == [float(bit) for bit in sample.loss_mask]
        own = []
        for start, end in model_runs(sample):
            call = next((c for c in unmatched if c.input_ids == sample.tokens[:start]
                         and c.output_ids == sample.tokens[start:end]), None)
            assert call is not None, (f"sample {sample.index}: no engine call was sent the {start} ids before this "
                                      "model turn and returned its ids")
            unmatched.remove(call)
            own.append(call)
        assert_engine_tokens(sample, own)
        turns += len(own)
    assert not unmatched, f"{len(unmatched)} of {len(calls)} engine calls are not a model turn of the batch"
    return turns


def run_recorded_rollout(model_dir, rollout_cfg, num_groups: int, **context: Any):
    """One rollout step (`run_rollout` of `num_groups` groups, `context`: more RolloutContext fields) against the
    tiny model behind an embedded engine; returns the batch and the engine calls it made."""
    from verst.engine.core import EngineConfig, EngineCore
    from verst.engine.process import BackgroundServer
    from verst.models.loader import load_model_and_tokenizer
    from verst.rollout.plugins import RolloutContext
    from verst.rollout.rollout_fn import run_rollout

    model, tokenizer = load_model_and_tokenizer(model_dir)

    async def main(url: str):
        async with EngineClient(url) as client:
            engine = RecordingEngine(client)
            ctx = RolloutContext(engine=engine, tokenizer=tokenizer, rollout=rollout_cfg, **context)
            try:
                return await run_rollout(ctx, num_groups), engine.calls
            finally:
                await ctx.aclose()

    with BackgroundServer(EngineCore(model, tokenizer, EngineConfig(max_running_requests=8))) as server:
        return asyncio.run(main(server.url))


def run_episodes(cfg, model_dir, prompts) -> list[tuple[Sample, list[EngineCall]]]:
    """Each prompt's episode (generate and reward, as a rollout runs it) against the tiny model behind an
    embedded engine, one at a time so that the recorded engine calls are that episode's."""
    from verst.engine.core import EngineConfig, EngineCore
    from verst.engine.process import BackgroundServer
    from verst.models.loader import load_model_and_tokenizer
    from verst.rollout import RolloutContext, generate_and_reward

    model, tok = load_model_and_tokenizer(model_dir)

    async def main(url: str):
        done = []
        async with EngineClient(url) as client:
            engine = RecordingEngine(client)
            ctx = RolloutContext.from_config(cfg, engine, tok, source=None)
            try:
                for sample in prompts:
                    engine.calls.clear()
                    done.append((await generate_and_reward(ctx, sample), list(engine.calls)))
            finally:
                await ctx.aclose()
        return done

    with BackgroundServer(EngineCore(model, tok, EngineConfig(max_running_requests=4))) as server:
        return asyncio.run(main(server.url))


def run_scripted_episodes(cfg, model_dir, script, prompts):
    """As `run_episodes`, against a scripted engine that replies with `script`'s turns (tool calls, answers
    a random tiny model would not write); its recorded calls are the engine's."""
    from verst.models import load_tokenizer
    from verst.rollout import RolloutContext, generate_and_reward
    from verst.session.scripted import ScriptedEngine

    tok = load_tokenizer(model_dir)

    async def main():
        done = []
        for sample in prompts:
            engine = ScriptedEngine(tok, script)
            async with EngineClient("http://scripted-engine", transport=engine) as client:
                ctx = RolloutContext.from_config(cfg, client, tok, source=None)
                try:
                    done.append((await generate_and_reward(ctx, sample), list(engine.calls)))
                finally:
                    await ctx.aclose()
        return done

    return asyncio.run(main())
