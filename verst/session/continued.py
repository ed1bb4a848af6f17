"""A turn continued across weight updates (partial rollouts): its engine calls joined into one reply, token in
token out, the streamed output growing across them, and the version of each output id."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from verst.inference_client.client import GenerateResult

OnTokens = Callable[[GenerateResult], None]
"""`on_tokens(partial)`: a streamed turn's output so far (every output id and logprob), after each update."""


def joined(calls: list[GenerateResult]) -> GenerateResult:
    """One turn's calls as one reply: every call's output ids and logprobs in order, the first call's rid, the
    last call's finish and weights, the prompt and cached tokens of all."""
    if len(calls) == 1:
        return calls[0]
    first, last = calls[0], calls[-1]
    return dataclasses.replace(
        last, rid=first.rid, output_ids=[t for c in calls for t in c.output_ids],
        logprobs=[lp for c in calls for lp in c.logprobs or []],
        prompt_tokens=sum(c.prompt_tokens for c in calls), cached_tokens=sum(c.cached_tokens for c in calls),
        completion_tokens=sum(len(c.output_ids) for c in calls), text="", routed_experts_flat=None)


def after(so_far: GenerateResult, on_tokens: OnTokens) -> OnTokens:
    """`on_tokens` of a continuing call: its partials behind the output the turn already streamed."""
    return lambda partial: on_tokens(dataclasses.replace(
        partial, rid=so_far.rid, output_ids=so_far.output_ids + partial.output_ids,
        logprobs=(so_far.logprobs or []) + (partial.logprobs or [])))


def token_versions(calls: list[GenerateResult]) -> list[int] | None:
    """Each output id's version: its call's. None when an update fell inside a call (retract, in_place: the
    engine says only the oldest and newest version) or a version is not a number."""
    versions: list[int] = []
    for c in calls:
        if c.oldest_weight_version != c.weight_version or not c.weight_version.isdigit():
            return None
        versions += [int(c.weight_version)] * len(c.output_ids)
    return versions
