"""Token accounting for connector tests: an engine client that records every generation it serves, and the
check that a batch trains on exactly those ids, with the loss mask on the model's turns only."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from verst.inference_client.client import EngineClient, GenerateResult
from verst.trainer.items import make_items
from verst.types import Sample


class RecordingEngine:
    """An EngineClient that keeps (input ids, output ids, logprobs) of every finished generation."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.calls: list[tuple[list[int], list[int], list[float]]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    async def generate(self, input_ids: list[int], *args: Any, **kwargs: Any) -> GenerateResult:
        result = await self.client.generate(input_ids, *args, **kwargs)
        self.calls.append((list(input_ids), list(result.output_ids), list(result.logprobs or [])))
        return result

    async def generate_stream(self, input_ids: list[int], *args: Any, **kwargs: Any) -> AsyncIterator[GenerateResult]:
        result = None
        async for result in self.client.generate_stream(input_ids, *args, **kwargs):
            yield result
        if result is not None:
            self.calls.append((list(input_ids), list(result.output_ids), list(result.logprobs or [])))


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


def check_trained_tokens_are_the_engines(samples: list[Sample], calls: list[tuple[list[int], list[int], list[float]]]
                                         ) -> int:
    """Every sample's trained item has the sample's ids; each run of loss-mask-1 tokens is exactly one
    engine call's output, with that call's logprobs, after exactly the ids that call was sent; every
    other token is masked; every engine call is one run. Returns the number of model turns."""
    # a group's samples send the same first prompt: calls are matched by input and output, each used once
    unmatched = [(tuple(ids), out, logprobs) for ids, out, logprobs in calls]
    items = make_items(samples)
    turns = 0
    for sample, item in zip(samples, items, strict=True):
        assert item.tokens.tolist() == sample.tokens
        assert item.loss_mask.tolist() == [float(bit) for bit in sample.loss_mask]
        offset = len(sample.tokens) - sample.response_length
        for start, end in model_runs(sample):
            turn = (tuple(sample.tokens[:start]), sample.tokens[start:end], sample.rollout_logprobs[start - offset:end - offset])
            assert turn in unmatched, (f"sample {sample.index}: no engine call was sent the {start} ids before this "
                                       "model turn and returned its ids and logprobs")
            unmatched.remove(turn)
            turns += 1
        masked = [lp for lp, bit in zip(sample.rollout_logprobs, sample.loss_mask) if not bit]
        assert all(lp == 0.0 for lp in masked), f"sample {sample.index}: a non-model token has a logprob"
    assert not unmatched, f"{len(unmatched)} of {len(calls)} engine calls are not a model turn of the batch"
    return turns
