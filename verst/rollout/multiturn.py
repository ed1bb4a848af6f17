"""A multi-turn generate fn without the session server, for comparison with the agentic path: the engine's
output ids and the ids of the environment's messages are appended directly to one id list, turn by turn.

The environment step (the protocol): `async def step(messages, metadata) -> list[dict] | None` receives
the conversation so far, ending with the parsed assistant reply (OpenAI shape, `tool_calls` when the
reply called tools), and a copy of the sample's metadata; it returns the messages to append (tool
results, user turns; never assistant ones), or None / [] to end the episode. Name it by import path in
`sample.metadata["env_step"]` (used by `generate`), or bind one: `MultiTurnGenerate(step, max_turns=8)`
is a generate fn. `sample.metadata["max_turns"]` overrides the turn limit; `["tools"]` are the tools.

With `rollout.partial_rollout` a turn whose engine call a weight update aborted goes on inside the turn: the
input ids and the output so far are sent again with the rest of the budget, and each output id keeps the
version that produced it (`Sample.token_versions`), as in the session server.
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from verst.config import load_object
from verst.models.prompts import prompt_messages
from verst.rollout.agentic import record_trajectory
from verst.rollout.generate import continues, mark_aborted, response_budget
from verst.rollout.keys import PROMPT_TOO_LONG_KEY
from verst.session.assemble import Trajectory, assemble
from verst.session.continued import joined, token_versions
from verst.session.manager import MISMATCH_KEY
from verst.session.messages import normalize_messages, parse_reply
from verst.session.tito import ChatTemplate, check_conversation
from verst.types import Sample

if TYPE_CHECKING:
    from verst.inference_client.client import GenerateResult
    from verst.rollout.plugins import RolloutContext

EnvStep = Callable[[list[dict[str, Any]], dict[str, Any]], Awaitable[list[dict[str, Any]] | None]]
ENV_STEP_KEY = "env_step"
MAX_TURNS_KEY = "max_turns"


class MultiTurnGenerate:
    """`async (ctx, sample) -> Sample`: up to `max_turns` engine calls, the environment stepping between them."""

    def __init__(self, env_step: EnvStep | None = None, max_turns: int = 8):
        if max_turns < 1:
            raise ValueError(f"MultiTurnGenerate: max_turns = {max_turns} must be >= 1")
        self.env_step, self.max_turns = env_step, max_turns

    async def __call__(self, ctx: RolloutContext, sample: Sample) -> Sample:
        if sample.response_length:
            raise ValueError(f"multi-turn generate: sample {sample.index} already has response_length = "
                             f"{sample.response_length}; an episode starts from the prompt")
        if not ctx.data.apply_chat_template:
            raise ValueError("multi-turn generate: data.apply_chat_template = false; turns are joined through the "
                             "chat template")
        if sample.index in ctx.state.stopped:
            return mark_aborted(sample, "the rollout step ended before generation started")
        step = self.env_step or _env_step_of(sample)
        max_turns = int(sample.metadata.get(MAX_TURNS_KEY, self.max_turns))
        tools = sample.metadata.get("tools")
        template = ChatTemplate(ctx.tokenizer, tools)
        messages = prompt_messages(sample.prompt, ctx.data.system_prompt)
        env_ids = template.prompt_ids(messages)
        budget, too_long = response_budget(ctx, len(env_ids))
        if too_long:
            sample.tokens, sample.metadata[PROMPT_TOO_LONG_KEY] = env_ids, len(env_ids)
            return mark_aborted(sample, too_long)
        trajectory, routing_key = Trajectory(), f"multiturn-{uuid.uuid4().hex}"
        for _ in range(max_turns):
            n_input = len(trajectory.ids) + len(env_ids)
            if trajectory.turns:
                budget = _room(ctx, n_input)
            if budget <= 0:
                trajectory.truncated = f"the next turn's prompt has {n_input} tokens, no room under max_context_tokens"
                break
            calls = await _turn_calls(ctx, sample, trajectory.ids + env_ids, budget, routing_key)
            result = joined(calls)
            trajectory.add_turn(env_ids, result.output_ids, result.logprobs or [], result.finish_reason,
                                calls[0].oldest_weight_version, prompt_tokens=result.prompt_tokens,
                                cached_tokens=result.cached_tokens, n_messages_before=len(messages),
                                later_versions=[c.oldest_weight_version for c in calls[1:]],
                                token_versions=token_versions(calls) if ctx.rollout.partial_rollout else None)
            reply = parse_reply(ctx.tokenizer.decode(result.output_ids, skip_special_tokens=True), bool(tools))
            messages.append(reply)
            if result.finish_reason != "stop" or sample.index in ctx.state.stopped:
                break
            new = await step(list(messages), dict(sample.metadata))
            if not new:
                break
            new = _environment_messages(new)
            ended = trajectory.sampled_end(len(trajectory.turns) - 1, ctx.tokenizer.eos_token_id)
            env_ids = template.append_ids(reply, new, ended)
            messages += new
        decode = lambda ids: ctx.tokenizer.decode(ids, skip_special_tokens=True)  # noqa: E731
        assembled = assemble(trajectory, max_tokens=ctx.rollout.max_context_tokens, decode=decode)
        ended = trajectory.sampled_end(len(trajectory.turns) - 1, ctx.tokenizer.eos_token_id)
        mismatches = check_conversation(template, messages, trajectory.ids, trajectory.model_mask(), ended)
        assembled.metadata.update({MISMATCH_KEY: [m.to_dict() for m in mismatches], "messages": messages})
        record_trajectory(ctx, sample, assembled)
        return sample.validate()


generate = MultiTurnGenerate()  # the environment step named by sample.metadata["env_step"]


def _env_step_of(sample: Sample) -> EnvStep:
    path = sample.metadata.get(ENV_STEP_KEY)
    if not isinstance(path, str):
        raise ValueError(f"multi-turn generate: sample {sample.index} has metadata[{ENV_STEP_KEY!r}] = {path!r}; "
                         "expected the import path of `async def step(messages, metadata) -> list[dict] | None`")
    return load_object(path, f"sample.metadata[{ENV_STEP_KEY!r}]")


def _environment_messages(new: Any) -> list[dict[str, Any]]:
    messages = normalize_messages(new, "env step messages")
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            raise ValueError(f"env step messages[{i}] has role 'assistant'; the environment appends tool, user or "
                             "system messages, the replies come from the engine")
    return messages


def _room(ctx: RolloutContext, n_input: int) -> int:
    limit = ctx.rollout.max_context_tokens
    return ctx.rollout.max_response_tokens if limit is None else min(ctx.rollout.max_response_tokens, limit - n_input)


async def _turn_calls(ctx: RolloutContext, sample: Sample, input_ids: list[int], budget: int,
                      routing_key: str) -> list[GenerateResult]:
    """The turn's engine calls: one, and with partial rollouts one more after each weight update that aborted
    the last (the input ids + the output so far, the rest of the budget)."""
    calls = [await _call_engine(ctx, sample, input_ids, budget, routing_key)]
    while continues(ctx, sample, calls[-1]) and (n := sum(len(c.output_ids) for c in calls)) < budget:
        calls.append(await _call_engine(ctx, sample, input_ids + joined(calls).output_ids, budget - n, routing_key))
    return calls


async def _call_engine(ctx: RolloutContext, sample: Sample, input_ids: list[int], max_new_tokens: int,
                       routing_key: str) -> GenerateResult:
    params = dict(ctx.sampling_params or {}, max_new_tokens=max_new_tokens)
    if ctx.rollout.sampling.seed is not None:
        params["sampling_seed"] = ctx.rollout.sampling.seed + sample.index
    rid = ctx.state.new_rid(sample)
    ctx.state.in_flight[rid] = sample.index
    try:
        # the routing key keeps every turn on the engine that holds the conversation's prefix
        return await ctx.engine.generate(input_ids, params, rid=rid, return_logprob=True, routing_key=routing_key)
    finally:
        ctx.state.in_flight.pop(rid, None)
