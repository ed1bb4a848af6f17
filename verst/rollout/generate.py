"""The default single-turn generate fn: prompt ids through the chat template (the text edge), one engine
call, and the engine's own output ids and logprobs recorded on the sample (token-in-token-out). With
`rollout.request_per = "group"`, `generate_samples` makes that one call for every sample of a prompt
(`sampling_params.n`), each recorded as its own call would be.

A prompt longer than `rollout.max_prompt_tokens` (or leaving no room under `max_context_tokens`) is
not sent: the sample comes back ABORTED with the reason in `metadata['generate_error']` and the
token count in `metadata['prompt_too_long']`, so one bad row costs one group, is counted in
`rollout/prompt_too_long`, and is never returned to the source to fail again.

With `rollout.partial_rollout`, a call a weight update aborted is sent again as prompt + the output so far with
the rest of the token budget: the sample keeps the first call's ids and logprobs exactly and goes on with the
new weights, each token's version in `token_versions`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any

from verst.models.prompts import encode_prompt
from verst.rollout.keys import PROMPT_TOO_LONG_KEY
from verst.rollout.worker import GENERATE_ERROR_KEY
from verst.types import Sample, Status

if TYPE_CHECKING:
    from verst.inference_client.client import GenerateResult
    from verst.rollout.plugins import RolloutContext

logger = logging.getLogger(__name__)

CONTINUED_KEY = "continued_after_weight_update"  # metadata: engine calls sent again after a weight update
CACHED_TOKENS_KEY = "cached_tokens"  # metadata: prompt tokens the engines served from the prefix cache
ENGINE_PROMPT_TOKENS_KEY = "engine_prompt_tokens"  # metadata: prompt tokens the engines were sent
FINISH_STATUS = {"stop": Status.COMPLETED, "length": Status.TRUNCATED, "abort": Status.ABORTED}
PROMPT_IDS_KEPT = 1024  # prompts whose ids are kept: the samples of a group start together


async def generate(ctx: RolloutContext, sample: Sample) -> Sample:
    """One engine call for one prompt; fills every per-token field, the status and the decoded text."""
    if sample.response_length:
        raise ValueError(
            f"single-turn generate: sample {sample.index} already has response_length = {sample.response_length}; "
            "continuing a partial response needs a multi-turn generate fn"
        )
    if sample.index in ctx.state.stopped:
        return mark_aborted(sample, "the rollout step ended before generation started")
    prompt_ids = prompt_ids_of(ctx, sample)
    max_new_tokens, too_long = response_budget(ctx, len(prompt_ids))
    if too_long:
        sample.tokens = prompt_ids
        sample.metadata[PROMPT_TOO_LONG_KEY] = len(prompt_ids)
        logger.warning("sample %d (group %d): %s", sample.index, sample.group_index, too_long)
        return mark_aborted(sample, too_long)
    params = request_params(ctx, sample, max_new_tokens)
    sample.token_versions = [] if ctx.rollout.partial_rollout else None  # one version a call otherwise
    result = await engine_call(ctx, sample, prompt_ids, params)
    record_result(ctx, sample, prompt_ids, result)
    return await go_on(ctx, sample, result, params, max_new_tokens)


async def generate_samples(ctx: RolloutContext, group: list[Sample]) -> list[Sample]:
    """`generate` for every sample of one prompt in one engine call (`rollout.request_per = "group"`): the
    engine's `sampling_params.n`, sample i seeded as the per-sample call would seed it (base seed + its index).
    A sample a weight update interrupted goes on alone (`rollout.partial_rollout`)."""
    first = group[0]
    if any(s.response_length for s in group):
        raise ValueError(f"single-turn generate: group {first.group_index} has samples with a response already; "
                         "continuing a partial response needs a multi-turn generate fn")
    indices = [s.index for s in group]
    if ctx.rollout.sampling.seed is not None and indices != list(range(first.index, first.index + len(group))):
        raise ValueError(f"group {first.group_index}: sample indices {indices} are not consecutive, so one request "
                         "cannot seed each sample with rollout.sampling.seed + its index")
    if first.index in ctx.state.stopped:
        return [mark_aborted(s, "the rollout step ended before generation started") for s in group]
    prompt_ids = prompt_ids_of(ctx, first)
    max_new_tokens, too_long = response_budget(ctx, len(prompt_ids))
    if too_long:
        logger.warning("group %d: %s", first.group_index, too_long)
        for s in group:
            s.tokens = list(prompt_ids)
            s.metadata[PROMPT_TOO_LONG_KEY] = len(prompt_ids)
            mark_aborted(s, too_long)
        return group
    params = request_params(ctx, first, max_new_tokens)
    rid = ctx.state.new_rid(first)
    ctx.state.in_flight[rid] = first.index  # aborting the rid aborts every sample
    try:
        experts = {"return_routed_experts": True} if ctx.routed_experts_top_k is not None else {}
        results = await ctx.engine.generate_samples(prompt_ids, params, len(group), rid=rid, **experts)
    finally:
        ctx.state.in_flight.pop(rid, None)
    for sample, result in zip(group, results, strict=True):
        sample.token_versions = [] if ctx.rollout.partial_rollout else None
        record_result(ctx, sample, prompt_ids, result)
    interrupted = [go_on(ctx, s, r, params, max_new_tokens) for s, r in zip(group, results) if continues(ctx, s, r)]
    await asyncio.gather(*interrupted)  # each alone, all at once
    return [s.validate() for s in group]


async def go_on(ctx: RolloutContext, sample: Sample, result: GenerateResult, params: dict[str, Any],
                max_new_tokens: int) -> Sample:
    """A call a weight update aborted goes on with the new weights from its last token (`rollout.partial_rollout`):
    the ids so far are the prompt, the budget is what is left; the sample, validated."""
    while continues(ctx, sample, result) and sample.response_length < max_new_tokens:
        sample.metadata[CONTINUED_KEY] = sample.metadata.get(CONTINUED_KEY, 0) + 1
        sample.metadata.pop(GENERATE_ERROR_KEY, None)  # the abort is not the sample's end
        left = dict(params, max_new_tokens=max_new_tokens - sample.response_length)
        if "sampling_seed" in left:
            left["sampling_seed"] = ctx.rollout.sampling.seed + sample.index
        result = await engine_call(ctx, sample, sample.tokens, left)
        record_result(ctx, sample, sample.tokens, result)
    return sample.validate()


async def engine_call(
    ctx: RolloutContext, sample: Sample, input_ids: list[int], params: dict[str, Any]
) -> GenerateResult:
    """One `/generate` of `input_ids`, in flight under a new rid (so a step's end can abort it)."""
    rid = ctx.state.new_rid(sample)
    ctx.state.in_flight[rid] = sample.index
    try:
        # asked only when recorded: engines (and test doubles) need not know the option otherwise
        experts = {"return_routed_experts": True} if ctx.routed_experts_top_k is not None else {}
        return await ctx.engine.generate(input_ids, params, rid=rid, return_logprob=True, **experts)
    finally:
        ctx.state.in_flight.pop(rid, None)


def continues(ctx: RolloutContext, sample: Sample, result: GenerateResult) -> bool:
    """Whether a partial rollout goes on: a weight update aborted the call, not the rollout step's end (whose
    aborts by rid SGLang reports with the same message as a weight update's)."""
    return (ctx.rollout.partial_rollout and result.aborted_for_weight_update
            and sample.index not in ctx.state.stopped)


def prompt_ids_of(ctx: RolloutContext, sample: Sample) -> list[int]:
    """`sample.tokens` when the prompt arrives already tokenized, else the chat template of its prompt, made
    once for the samples of a group (copies of one prompt) and kept by the prompt and tools it rendered."""
    if sample.tokens:
        return list(sample.tokens)
    tools = sample.metadata.get("tools")
    key = (repr(sample.prompt), repr(tools))
    cache = ctx.state.prompt_ids
    ids = cache.get(key)
    if ids is None:
        ids = cache[key] = encode_prompt(ctx.tokenizer, sample.prompt, apply_chat_template=ctx.data.apply_chat_template,
                                         system_prompt=ctx.data.system_prompt, tools=tools)
        if len(cache) > PROMPT_IDS_KEPT:
            cache.popitem(last=False)
    return list(ids)


def response_budget(ctx: RolloutContext, n_prompt: int) -> tuple[int, str | None]:
    """(max_new_tokens, None), or (0, why the prompt is rejected)."""
    r = ctx.rollout
    if n_prompt > r.max_prompt_tokens:
        return 0, f"prompt has {n_prompt} tokens > rollout.max_prompt_tokens = {r.max_prompt_tokens}"
    budget = r.max_response_tokens
    if r.max_context_tokens is not None:
        room = r.max_context_tokens - n_prompt
        if room <= 0:
            limit = r.max_context_tokens
            return 0, f"prompt has {n_prompt} tokens, rollout.max_context_tokens = {limit} leaves no room"
        budget = min(budget, room)
    return budget, None


def record_result(ctx: RolloutContext, sample: Sample, prompt_ids: list[int], result: GenerateResult) -> None:
    """Token-in-token-out: tokens = prompt ids + the engine's output ids, logprobs as the engine sent them.
    `prompt_ids` of a continued call are the sample's tokens so far: its output, logprobs and versions are
    appended to theirs, and the status and text are the whole response's."""
    n = len(result.output_ids)
    if result.logprobs is None or len(result.logprobs) != n:
        got = None if result.logprobs is None else len(result.logprobs)
        raise ValueError(f"engine reply for rid {result.rid!r}: {got} output logprobs for {n} output ids")
    status = finish_status(result.finish_reason, result.rid)
    sample.tokens = list(prompt_ids) + list(result.output_ids)
    sample.response_length += n
    sample.loss_mask += [1] * n
    sample.rollout_logprobs += list(result.logprobs)
    record_token_versions(sample, result)
    if ctx.routed_experts_top_k is not None:
        experts = result.routed_experts(ctx.routed_experts_top_k)
        if experts is None:
            raise ValueError(f"engine reply for rid {result.rid!r} carries no routed_experts; algorithm.routing_replay "
                             "needs engines that return them")
        # [len(tokens) - 1, moe_layers, top_k]: prompt and output; a continued call's cover the whole sequence
        sample.routed_experts = experts.tolist()
    # Staleness counts from the oldest weights behind any token, not the version that finished the call;
    # a weight sync inside the call adds the newest too, so `rollout/mixed_version_ratio` sees it.
    sample.weight_versions.append(result.oldest_weight_version)
    if result.weight_version != result.oldest_weight_version:
        sample.weight_versions.append(result.weight_version)
    ctx.state.observe_version(result.weight_version)
    sample.status = status
    # Text only for rewards and logs, decoded from exactly the ids the trainer will see.
    sample.response = ctx.tokenizer.decode(sample.response_tokens, skip_special_tokens=True)
    meta = sample.metadata
    meta[CACHED_TOKENS_KEY] = meta.get(CACHED_TOKENS_KEY, 0) + result.cached_tokens
    meta[ENGINE_PROMPT_TOKENS_KEY] = meta.get(ENGINE_PROMPT_TOKENS_KEY, 0) + result.prompt_tokens
    if status is Status.ABORTED:
        message = result.meta_info.get("finish_reason", {}).get("message") if result.meta_info else None
        meta[GENERATE_ERROR_KEY] = f"aborted by the engine: {message or 'no message'}"


def record_token_versions(sample: Sample, result: GenerateResult) -> None:
    """Every output token of the call gets the call's version; a call a weight update fell inside (retract,
    in_place) does not say which tokens came before it, so the sample's `token_versions` become unknown."""
    if sample.token_versions is None:
        return
    version = result.weight_version
    if result.oldest_weight_version != version or not version.isdigit():
        sample.token_versions = None
        return
    sample.token_versions += [int(version)] * len(result.output_ids)


def mark_aborted(sample: Sample, reason: str) -> Sample:
    sample.status = Status.ABORTED
    sample.metadata[GENERATE_ERROR_KEY] = reason
    return sample


def finish_status(reason: str, rid: str = "") -> Status:
    """The Sample status of an engine finish reason: stop → COMPLETED, length → TRUNCATED, abort → ABORTED."""
    if reason not in FINISH_STATUS:
        known = sorted(FINISH_STATUS)
        raise ValueError(f"engine reply for rid {rid!r}: finish_reason {reason!r} is not one of {known}")
    return FINISH_STATUS[reason]


def request_params(ctx: RolloutContext, sample: Sample, max_new_tokens: int) -> dict[str, Any]:
    """The config's sampling params plus this request's token budget and seed (base seed + sample index)."""
    params = dict(ctx.sampling_params or {}, max_new_tokens=max_new_tokens)
    if ctx.rollout.sampling.seed is not None:
        params["sampling_seed"] = ctx.rollout.sampling.seed + sample.index
    return params
