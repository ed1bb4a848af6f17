"""Strands Agents as verst's agent fn: each episode is one Strands agent run whose OpenAI model provider points
at the sample's session on the session server, which records the exact token ids the engines sampled.

    # my_agent.py                                   # the recipe
    from strands import Agent                       # [rollout]
    from verst.connectors.strands import StrandsAgent        # generate_fn = "verst.rollout.agentic:generate"
    run = StrandsAgent(lambda model, metadata: Agent(model=model, tools=[...], callback_handler=None))
                                                    # agent_fn = "my_agent:run"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai
from strands import Agent
from strands.models.openai import OpenAIModel
from strands.types.exceptions import MaxTokensReachedException

ANSWER_KEY = "final_answer"  # sample.metadata: the agent's last reply text (None when it was cut off)
STOP_KEY = "agent_stop"  # sample.metadata: the agent loop's stop reason ("end_turn", "max_tokens", ...)
TURNS_KEY = "agent_turns"  # sample.metadata: model calls of the agent loop
TOOL_CALLS_KEY = "tool_calls"  # sample.metadata: tool calls the model made (eval/tool_calls_mean)
# The session server shares the rollout manager's process with every other episode: on a busy machine the
# client's default 5 s connect timeout would cut off whole groups.
TIMEOUT = openai.Timeout(600.0, connect=60.0)

AgentFactory = Callable[[OpenAIModel, dict[str, Any]], Agent]
"""`make_agent(model, metadata) -> Agent`: a fresh agent for one episode, on the given model provider;
`metadata` is a copy of the sample's metadata (the task's fields)."""


class StrandsAgent:
    """An agent fn (`rollout.agent_fn`, with `rollout.generate_fn = "verst.rollout.agentic:generate"`) that
    runs one Strands agent per episode.

    The agentic generate fn opens a session per sample and calls this with the session's OpenAI base URL:
    it builds an `OpenAIModel` whose client talks to the session (model id `model`, request parameters
    from `[rollout.sampling]` and `rollout.max_response_tokens`), asks `make_agent` for a fresh agent on
    it and invokes the agent on the sample's prompt. The sample is the session's trajectory: the engine's
    ids on the model's turns (loss mask 1), the chat template's and tools' ids between them (mask 0).
    It returns `final_answer`, `agent_stop`, `agent_turns` and `tool_calls` for the sample's metadata
    (the reward reads them there). A model call cut off by the token limit ends the episode (the
    trajectory is TRUNCATED, `final_answer` None); any other exception from the agent aborts the sample.
    `max_turns` caps the agent loop's model calls (Strands' `limits`).

    The session accepts only an append-only history, so the agent's conversation manager must not trim
    or summarise within an episode (`NullConversationManager` never does).
    """

    def __init__(self, make_agent: AgentFactory, *, max_turns: int | None = None, model: str = "verst"):
        if not callable(make_agent):
            raise TypeError(f"StrandsAgent: make_agent must be callable (model, metadata) -> Agent, "
                            f"got {type(make_agent).__name__}")
        if max_turns is not None and max_turns < 1:
            raise ValueError(f"StrandsAgent: max_turns = {max_turns} must be >= 1")
        self.make_agent, self.max_turns, self.model = make_agent, max_turns, model

    async def __call__(self, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                       metadata: dict[str, Any]) -> dict[str, Any]:
        # max_retries=0: the session server reads a resent request as a retry of the last turn
        client_args = {"base_url": base_url, "api_key": "unused", "max_retries": 0, "timeout": TIMEOUT}
        model = OpenAIModel(client_args=client_args, model_id=self.model, params=dict(request_kwargs))
        agent = self.make_agent(model, metadata)
        if not isinstance(agent, Agent):
            raise TypeError(f"StrandsAgent: make_agent returned {type(agent).__name__}; expected a strands Agent")
        limits = {"turns": self.max_turns} if self.max_turns is not None else None
        try:
            result = await agent.invoke_async(strands_prompt(prompt), limits=limits)
            answer, stop = _text(result.message), str(result.stop_reason)
        except MaxTokensReachedException:
            answer, stop = None, "max_tokens"
        return {ANSWER_KEY: answer, STOP_KEY: stop, TURNS_KEY: _model_calls(agent), TOOL_CALLS_KEY: _tool_calls(agent)}


def strands_prompt(prompt: Any) -> str | list[dict[str, Any]]:
    """The data prompt as Strands input: text as is, chat messages as Strands messages. A system message
    belongs to the agent (`Agent(system_prompt=...)`), so one in the prompt is refused."""
    if isinstance(prompt, str):
        return prompt
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"the Strands agent fn needs a text or chat-message prompt, got {prompt!r:.80}")
    messages = []
    for i, message in enumerate(prompt):
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant") or not isinstance(content, str):
            raise ValueError(f"prompt[{i}] has role {role!r} and content {content!r:.40}; the Strands agent fn "
                             "takes user and assistant text messages (a system prompt is the agent's)")
        messages.append({"role": role, "content": [{"text": content}]})
    return messages


def _text(message: dict[str, Any]) -> str:
    return "".join(block.get("text", "") for block in message.get("content", []))


def _tool_calls(agent: Agent) -> int:
    return sum("toolUse" in block for message in agent.messages for block in message.get("content", []))


def _model_calls(agent: Agent) -> int:
    invocation = agent.event_loop_metrics.latest_agent_invocation
    return len(invocation.cycles) if invocation is not None else 0
