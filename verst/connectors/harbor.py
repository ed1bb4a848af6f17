"""Harbor (`harbor`) as an agent fn: one sample is one Harbor trial (a task, an agent, an environment and
the task's verifier), whose agent's model calls go through the session server, so their tokens are recorded.

Harbor needs Python >= 3.12, so each trial runs `harbor_episode.py` in Harbor's own environment (`make
agents` creates .venv-harbor); verst's side only spawns it.

    run = HarborAgent("terminus-2", environment="docker")

The task folder is the sample's `metadata["harbor_task"]` (or the `task` given here). The agent's model is
`model_name` (LiteLLM's `openai/...` route: an OpenAI-compatible server) at the session's base URL, passed
as harbor's `base_url` override or, with `base_url_option`, as that agent option. The result merged into
the metadata: `harbor_rewards` (the verifier's), `harbor_reward` (its `reward` entry), `harbor_exception`
and `harbor_agent`; `verifier_reward` is the matching reward fn. A trial that ended in an exception
before the verifier ran raises it, so the sample is aborted with the reason.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from verst.connectors.child import default_pythonpath, interpreter, run_child
from verst.rewards import RewardError
from verst.types import Sample

TASK_KEY, REWARD_KEY = "harbor_task", "harbor_reward"
EPISODE = Path(__file__).with_name("harbor_episode.py")
DEFAULT_PYTHON = ".venv-harbor/bin/python"
PYTHON_ENV = "VERST_HARBOR_PYTHON"


class HarborAgent:
    """An agent fn over Harbor trials: `agent` is a harbor agent name ("terminus-2", ...) or `module:Class`,
    `environment` a harbor environment type ("docker", "daytona", ...) or `module:Class`."""

    def __init__(self, agent: str, *, environment: str = "docker", task: str | os.PathLike | None = None,
                 model_name: str = "openai/verst", agent_kwargs: dict[str, Any] | None = None,
                 environment_kwargs: dict[str, Any] | None = None, base_url_option: str | None = None,
                 python: str | os.PathLike | None = None, pythonpath: list[str] | None = None,
                 timeout_s: float = 3600.0):
        self.job = {"agent": agent, "environment": environment, "model_name": model_name,
                    "agent_kwargs": agent_kwargs or {}, "environment_kwargs": environment_kwargs or {},
                    "base_url_option": base_url_option}
        self.task, self.python, self.pythonpath, self.timeout_s = task, python, pythonpath, timeout_s

    async def __call__(self, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                       metadata: dict[str, Any]) -> dict[str, Any]:
        python = interpreter(self.python, PYTHON_ENV, DEFAULT_PYTHON, "Harbor", "harbor")
        task = metadata.get(TASK_KEY) or self.task
        if task is None:
            raise KeyError(f"no Harbor task: the sample's metadata has no {TASK_KEY!r} (keys {sorted(metadata)}) "
                           "and the HarborAgent names none")
        job = {**self.job, "base_url": base_url, "task_path": str(Path(task).resolve())}
        result = await run_child(python, EPISODE, job, pythonpath=self.pythonpath or default_pythonpath(),
                                 timeout_s=self.timeout_s)
        rewards = result["rewards"]
        if rewards is None and result["exception"] is not None:
            exc = result["exception"]
            raise RuntimeError(f"harbor trial {result['trial_name']}: {exc.get('exception_type')}: "
                               f"{exc.get('exception_message')}")
        return {"harbor_rewards": rewards, REWARD_KEY: (rewards or {}).get("reward"),
                "harbor_exception": result["exception"], "harbor_agent": result["agent_metadata"]}


async def verifier_reward(sample: Sample) -> float:
    """The verifier's `reward` (`reward.type = "custom"`)."""
    reward = sample.metadata.get(REWARD_KEY)
    if reward is None:
        raise RewardError(f"sample {sample.index}: metadata has no {REWARD_KEY!r} (harbor_rewards = "
                          f"{sample.metadata.get('harbor_rewards')!r}); this reward needs a HarborAgent agent fn "
                          "and a verifier that writes a `reward`")
    return float(reward)
