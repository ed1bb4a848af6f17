"""Strands Agents as verst's generate fn: each sample is one Strands agent run whose OpenAI model provider
points at the sample's session on the session server, which records the exact token ids the engines sampled.

    # my_agent.py                                   # the recipe
    from strands import Agent                       # [rollout]
    from verst.connectors.strands import StrandsGenerate     # generate_fn = "my_agent:generate"
    generate = StrandsGenerate(lambda model, metadata: Agent(model=model, tools=[...], callback_handler=None))
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import openai
from strands import Agent
from strands.models.openai import OpenAIModel
from strands.types.exceptions import MaxTokensReachedException

from verst.rollout import agentic
from verst.rollout.plugins import RolloutContext
from verst.types import Sample

ANSWER_KEY = "final_answer"  # sample.metadata: the agent's last reply text (None when it was cut off)
STOP_KEY = "agent_stop"  # sample.metadata: the agent loop's stop reason ("end_turn", "max_tokens", ...)
TURNS_KEY = "agent_turns"  # sample.metadata: model calls of the agent loop
# The session server shares the rollout manager's process with every other episode: on a busy machine the
# client's default 5 s connect timeout would cut off whole groups.
TIMEOUT = openai.Timeout(600.0, connect=60.0)

AgentFactory = Callable[[OpenAIModel, dict[str, Any]], Agent]
"""`make_agent(model, metadata) -> Agent`: a fresh agent for one episode, on the given model provider;
`metadata` is a copy of the sample's metadata (the task's fields)."""


class StrandsGenerate:
    """A generate fn (`rollout.generate_fn`) that runs one Strands agent per sample.

    For each sample the agentic generate fn (verst.rollout.agentic) opens a session; this builds an
    `OpenAIModel` whose client talks to the session (model id `model`, request parameters from
    `[rollout.sampling]` and `rollout.max_response_tokens`), asks `make_agent` for an agent on it and
    invokes the agent on the sample's prompt. The sample is the session's trajectory: the engine's ids
    on the model's turns (loss mask 1), the chat template's and tools' ids between them (mask 0).
    `final_answer`, `agent_stop` and `agent_turns` go into the sample's metadata for the reward. A model
    call cut off by the token limit ends the episode (the trajectory is TRUNCATED); any other exception
    from the agent aborts the sample. `max_turns` caps the agent loop's model calls (Strands' `limits`).

    The session accepts only an append-only history, so the agent's conversation manager must not trim
    or summarise within an episode (the default sliding window of 40 messages is enough for short ones).
    """

    def __init__(self, make_agent: AgentFactory, *, max_turns: int | None = None, model: str = "verst"):
        if not callable(make_agent):
            raise TypeError(f"StrandsGenerate: make_agent must be callable (model, metadata) -> Agent, "
                            f"got {type(make_agent).__name__}")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"StrandsGenerate: max_turns = {max_turns} must be >= 1")
        self.make_agent, self.max_turns, self.model = make_agent, max_turns, model

    async def __call__(self, ctx: RolloutContext, sample: Sample) -> Sample:
        if ctx.agent_fn is not None:
            raise ValueError(f"rollout.agent_fn = {ctx.rollout.agent_fn!r} is set, but the Strands generate fn runs "
                             "its own agent; unset rollout.agent_fn")
        return await agentic.generate(dataclasses.replace(ctx, agent_fn=self.episode), sample)

    async def episode(self, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                      metadata: dict[str, Any]) -> dict[str, Any]:
        """One agent run against the session at `base_url` (an agent fn)."""
        # max_retries=0: the session server reads a resent request as a retry of the last turn
        client_args = {"base_url": base_url, "api_key": "unused", "max_retries": 0, "timeout": TIMEOUT}
        model = OpenAIModel(client_args=client_args, model_id=self.model, params=dict(request_kwargs))
        agent = self.make_agent(model, metadata)
        if not isinstance(agent, Agent):
            raise TypeError(f"StrandsGenerate: make_agent returned {type(agent).__name__}; expected a strands Agent")
        limits = {"turns": self.max_turns} if self.max_turns is not None else None
        try:
            result = await agent.invoke_async(strands_prompt(prompt), limits=limits)
        except MaxTokensReachedException:
            return {ANSWER_KEY: None, STOP_KEY: "max_tokens", TURNS_KEY: _model_calls(agent)}
        return {ANSWER_KEY: _text(result.message), STOP_KEY: str(result.stop_reason), TURNS_KEY: _model_calls(agent)}


def strands_prompt(prompt: Any) -> str | list[dict[str, Any]]:
    """The data prompt as Strands input: text as is, chat messages as Strands messages. A system message
    belongs to the agent (`Agent(system_prompt=...)`), so one in the prompt is refused."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"the Strands generate fn needs a text or chat-message prompt, got {prompt!r:.80}")
    messages = []
    for i, message in enumerate(prompt):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant") or not isinstance(content, str):
            raise ValueError(f"prompt[{i}] has role {role!r} and content {content!r:.40}; the Strands generate fn "
                             "takes user and assistant text messages (a system prompt is the agent's)")
        messages.append({"role": role, "content": [{"text": content}]})
    return messages


def _text(message: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in message.get("content", []))


def _model_calls(agent: Agent) -> int:
    invocation = agent.event_loop_metrics.latest_agent_invocation
    return len(invocation.cycles) if invocation is not None else 0
