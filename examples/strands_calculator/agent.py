"""A Strands agent for the calculator task, trained by verst through the Strands connector (an agent fn):
the agent (strands' own API, its calculator as a `@tool`) runs each episode against the session server.

    [rollout]
    generate_fn = "verst.rollout.agentic:generate"
    agent_fn = "examples.strands_calculator.agent:run"
    [reward]
    type = "custom"
    path = "examples.calculator.reward:final_answer"   # reads metadata["final_answer"]

The data is the calculator task's (`python -m examples.calculator.make_data`); the tool keeps the task's
name, description and argument, so the chat template renders the schema the task's data teaches.
"""

from __future__ import annotations

from typing import Any

from strands import Agent, tool
from strands.agent.conversation_manager import NullConversationManager
from strands.models.openai import OpenAIModel

from verst.connectors.strands import StrandsAgent
from verst.data.calculator import ToolError, step

MAX_TURNS = 5  # model calls per episode: a 2-step problem needs 3 (two tool calls, then the answer)


@tool
def calculator(expression: str) -> str:
    """Does one step of an expression"""
    try:
        return step(expression)
    except ToolError as e:  # reported back to the model, as an API would, rather than ending the episode
        return f"error: {e}"


def make_agent(model: OpenAIModel, metadata: dict[str, Any]) -> Agent:
    """A fresh agent per episode. No printing, and no conversation trimming: the session's history is
    append-only."""
    return Agent(model=model, tools=[calculator], callback_handler=None,
                 conversation_manager=NullConversationManager())


run = StrandsAgent(make_agent, max_turns=MAX_TURNS)
