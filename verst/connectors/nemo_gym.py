"""NeMo Gym (`nemo-gym`) as an agent fn: one sample is one NeMo Gym rollout (resources server + agent +
policy model), whose policy model calls go through the session server, so their tokens are recorded.

NeMo Gym needs Python >= 3.12, so each episode runs `nemo_gym_episode.py` in NeMo Gym's own environment
(`make agents` creates .venv-nemo-gym) with the session's base URL; verst's side only spawns it.

    run = NemoGymAgent("examples.nemo_gym.resources:AddResourcesServer")

The sample's metadata holds the NeMo Gym dataset row under `nemo_gym_row` (`responses_create_params`
and the resources server's verification fields); a row without `input` gets the data prompt. The run's
sampling settings go into `responses_create_params` (temperature, top_p, max_output_tokens). The result
merged into the metadata: `nemo_gym_reward` (the resources server's verify reward) and `nemo_gym_output`
(the agent's Responses API output items); `verify_reward` is the matching reward fn.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from verst.connectors.child import default_pythonpath, interpreter, run_child
from verst.models.prompts import prompt_messages
from verst.rewards import RewardError
from verst.types import Sample

ROW_KEY, REWARD_KEY = "nemo_gym_row", "nemo_gym_reward"
EPISODE = Path(__file__).with_name("nemo_gym_episode.py")
DEFAULT_PYTHON = ".venv-nemo-gym/bin/python"
PYTHON_ENV = "VERST_NEMO_GYM_PYTHON"


class NemoGymAgent:
    """An agent fn over a NeMo Gym resources server (`module:Class`, a `SimpleResourcesServer`) and agent
    (`module:Class`; NeMo Gym's `simple_agent` by default). `resources_config` and `agent_config` are
    those servers' extra config fields (`max_steps` for the simple agent)."""

    def __init__(self, resources_server: str, *, resources_config: dict[str, Any] | None = None,
                 agent: str | None = None, agent_config: dict[str, Any] | None = None,
                 python: str | os.PathLike | None = None, pythonpath: list[str] | None = None,
                 timeout_s: float = 900.0):
        self.job = {"resources_server": resources_server, "resources_config": resources_config or {},
                    "agent_config": agent_config or {}, **({"agent": agent} if agent else {})}
        self.python, self.pythonpath, self.timeout_s = python, pythonpath, timeout_s

    async def __call__(self, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                       metadata: dict[str, Any]) -> dict[str, Any]:
        python = interpreter(self.python, PYTHON_ENV, DEFAULT_PYTHON, "NeMo Gym", "nemo_gym")
        row = task_row(prompt, request_kwargs, metadata)
        verified = await run_child(python, EPISODE, {**self.job, "base_url": base_url, "row": row},
                                   pythonpath=self.pythonpath or default_pythonpath(), timeout_s=self.timeout_s)
        return {REWARD_KEY: verified.get("reward"), "nemo_gym_output": verified.get("response", {}).get("output")}


def task_row(prompt: Any, request_kwargs: dict[str, Any], metadata: dict[str, Any]) -> dict[str, Any]:
    """The NeMo Gym row for this episode: the sample's row, its input defaulting to the data prompt, with
    the run's sampling settings."""
    if ROW_KEY not in metadata:
        raise KeyError(f"sample metadata has no {ROW_KEY!r} (keys {sorted(metadata)}); a NeMo Gym task row "
                       "holds `responses_create_params` and the resources server's fields")
    row = dict(metadata[ROW_KEY])
    params = dict(row.get("responses_create_params") or {})
    params.setdefault("input", prompt_messages(prompt))
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("max_tokens", "max_output_tokens")):
        if ours in request_kwargs:
            params[theirs] = request_kwargs[ours]
    row["responses_create_params"] = params
    return row


async def verify_reward(sample: Sample) -> float:
    """The resources server's verify reward (`reward.type = "custom"`)."""
    reward = sample.metadata.get(REWARD_KEY)
    if reward is None:
        raise RewardError(f"sample {sample.index}: metadata has no {REWARD_KEY!r} (keys {sorted(sample.metadata)}); "
                          "this reward needs a NemoGymAgent agent fn")
    return float(reward)
