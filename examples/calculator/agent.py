"""An agent fn for the calculator task, written with the official `openai` client: ask the model, run
every calculator call it makes, send the results back, until it answers without a tool call.

verst calls `run(base_url, prompt, request_kwargs, metadata)` with the session's OpenAI base URL; the
dict it returns is merged into the sample's metadata (the reward reads `final_answer` from there).
"""

from __future__ import annotations

from typing import Any

import openai

from verst.data.calculator import TOOL_NAME, ToolError, calculate

MAX_TURNS = 5  # model calls per episode: a 2-step problem needs 3 (two tool calls, then the answer)
# The session server shares its process with every other episode of the rollout: on a busy CPU machine
# the client's default 5 s connect timeout cuts off whole groups, so connecting may take a minute.
TIMEOUT = openai.Timeout(600.0, connect=60.0)


async def run(base_url: str, prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """One episode; returns {"final_answer": text or None, "agent_turns": model calls, "tool_calls": calls
    run, "tool_errors": calls the calculator refused, "agent_end": "answer" | "length" | "max_turns"}.

    (Not "turns": the sample's metadata keeps the session's per-turn records under that key.)"""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    tools = metadata.get("tools")
    result: dict[str, Any] = {"final_answer": None, "agent_turns": 0, "tool_calls": 0, "tool_errors": 0,
                              "agent_end": "max_turns"}
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=TIMEOUT) as client:
        for _ in range(MAX_TURNS):
            completion = await client.chat.completions.create(
                model="verst", messages=messages, tools=tools, **request_kwargs
            )
            result["agent_turns"] += 1
            choice = completion.choices[0]
            message = choice.message
            messages.append(message.model_dump(exclude_none=True))
            if choice.finish_reason == "length":  # cut off mid-turn, or no room left in the context
                result["agent_end"] = "length"
                break
            if not message.tool_calls:
                result["final_answer"], result["agent_end"] = message.content, "answer"
                break
            for call in message.tool_calls:
                content, ok = run_tool(call.function.name, call.function.arguments)
                result["tool_calls"] += 1
                result["tool_errors"] += not ok
                messages.append({"role": "tool", "tool_call_id": call.id, "content": content})
    return result


def run_tool(name: str, arguments: str) -> tuple[str, bool]:
    """(the tool message's text, whether the call ran): a refused call is reported back to the model,
    as an API would, rather than ending the episode."""
    if name != TOOL_NAME:
        return f"error: unknown tool {name!r}; the only tool is {TOOL_NAME!r}", False
    try:
        return str(calculate(arguments)), True
    except ToolError as e:
        return f"error: {e}", False
