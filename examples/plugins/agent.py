"""An agent fn (`rollout.agent_fn`, with `rollout.generate_fn = "verst.rollout.agentic:generate"`):
`async (base_url, prompt, request_kwargs, metadata) -> dict | None` runs one episode against the session
server's OpenAI-compatible URL; the dict it returns is merged into the sample's metadata. This one asks
once and reports the answer; examples/calculator/agent.py runs a multi-turn tool loop.

    [rollout]
    generate_fn = "verst.rollout.agentic:generate"
    agent_fn = "examples.plugins.agent:ask_once"
"""

from __future__ import annotations

from typing import Any

import openai


async def ask_once(base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                   metadata: dict[str, Any]) -> dict[str, Any]:
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    # The session server needs no key; max_retries=0: a resent request means "retry the last turn".
    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        reply = await client.chat.completions.create(model="policy", messages=messages,
                                                     tools=metadata.get("tools"), **request_kwargs)
    return {"final_answer": reply.choices[0].message.content, "agent_turns": 1}
