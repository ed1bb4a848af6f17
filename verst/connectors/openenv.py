"""OpenEnv (`pip install 'verst[openenv]'`, openenv-core) as an agent fn: one sample is one episode of an
OpenEnv environment, whose every model turn goes through the session server, so its tokens are recorded.

    run = OpenEnvAgent(connect=lambda meta: MyEnvClient(base_url=meta["openenv_url"]),
                       act=lambda text: MyAction(answer=text), observe=lambda obs: obs.feedback)

The episode: `env.reset(**metadata["openenv_reset"])`; the data prompt and the first observation are the
first user message; each reply becomes an action (`act`), each step's observation the next user message,
until the environment says `done`, the model is cut off (`finish_reason == "length"`) or `max_steps`.
The result merged into the sample's metadata: `openenv_reward` (the sum of the step rewards, None if the
environment gave none), `openenv_rewards`, `openenv_done`, `agent_turns` and `agent_end`
("done" | "length" | "max_steps"); `env_reward` is the matching reward fn.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import openai

from verst.models.prompts import prompt_messages
from verst.rewards import RewardError
from verst.types import Sample

RESET_KEY = "openenv_reset"  # sample.metadata: keyword arguments for env.reset (seed, episode_id, ...)
REWARD_KEY = "openenv_reward"
# The session server shares its process with the rollout's other episodes: allow slow connects.
TIMEOUT = openai.Timeout(600.0, connect=60.0)


def _text(observation: Any) -> str:
    """An observation's fields, less the bookkeeping ones (done, reward, metadata), as `name: value` lines."""
    fields = observation if isinstance(observation, dict) else observation.model_dump()
    return "\n".join(f"{k}: {v}" for k, v in fields.items() if k not in ("done", "reward", "metadata"))


class OpenEnvAgent:
    """An agent fn over an OpenEnv environment client (`openenv.core.EnvClient`).

    connect(metadata) -> an unconnected EnvClient for this episode (the client opens its own WebSocket
    session, so episodes run side by side); act(reply text) -> the action to step (an Action or, for
    `GenericEnvClient`, a dict); observe(observation) -> the user message's text (default: its fields).
    """

    def __init__(self, connect: Callable[[dict[str, Any]], Any], act: Callable[[str], Any], *,
                 observe: Callable[[Any], str] = _text, max_steps: int = 4, model: str = "verst"):
        if max_steps < 1:
            raise ValueError(f"OpenEnvAgent: max_steps = {max_steps}; an episode needs at least one step")
        self.connect, self.act, self.observe = connect, act, observe
        self.max_steps, self.model = max_steps, model

    async def __call__(self, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                       metadata: dict[str, Any]) -> dict[str, Any]:
        messages = prompt_messages(prompt) if prompt else []
        rewards: list[float] = []
        result: dict[str, Any] = {"agent_turns": 0, "agent_end": "max_steps", "openenv_done": False}
        async with self.connect(metadata) as env, \
                openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=TIMEOUT) as llm:
            step = await env.reset(**metadata.get(RESET_KEY, {}))
            messages = _with_user(messages, self.observe(step.observation))
            for _ in range(self.max_steps):
                completion = await llm.chat.completions.create(model=self.model, messages=messages, **request_kwargs)
                result["agent_turns"] += 1
                choice = completion.choices[0]
                messages.append(choice.message.model_dump(exclude_none=True))
                if choice.finish_reason == "length":  # cut off mid-reply, or the session's context is full
                    result["agent_end"] = "length"
                    break
                step = await env.step(self.act(choice.message.content or ""))
                if step.reward is not None:
                    rewards.append(float(step.reward))
                if step.done:
                    result["agent_end"], result["openenv_done"] = "done", True
                    break
                messages.append({"role": "user", "content": self.observe(step.observation)})
        result["openenv_rewards"] = rewards
        result[REWARD_KEY] = sum(rewards) if rewards else None
        return result


def _with_user(messages: list[dict[str, Any]], text: str) -> list[dict[str, Any]]:
    """The first observation joins the data prompt's last user message, or opens the conversation."""
    if messages and messages[-1]["role"] == "user" and isinstance(messages[-1].get("content"), str):
        return [*messages[:-1], {**messages[-1], "content": f"{messages[-1]['content']}\n\n{text}"}]
    return [*messages, {"role": "user", "content": text}]


async def env_reward(sample: Sample) -> float:
    """The episode's summed environment reward (`reward.type = "custom"`); 0.0 when the environment gave none."""
    if REWARD_KEY not in sample.metadata:
        raise RewardError(f"sample {sample.index}: metadata has no {REWARD_KEY!r} (keys {sorted(sample.metadata)}); "
                          "this reward needs an OpenEnvAgent agent fn")
    reward = sample.metadata[REWARD_KEY]
    return 0.0 if reward is None else float(reward)
